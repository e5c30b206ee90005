"""The model zoo's architectures: published architectures at published sizes, described from
shapes alone.

Parameter totals are checked against formulas written out here (not read from the code) and
against the published figures, layer tables against the parameters they own, and tiny configs of
each model run for real. The registry and the compile service over gRPC are tested in
test_model_zoo_service.py.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from accelmesh.programs import OutputSpec, Program, TensorSpec
from compile_svc.programs import describe_layers, program_digest
from compile_svc.programs.layers import ProgramEntry
from compile_svc.programs.network import Layer, Network
from compile_svc.programs.zoo import bert, gpt2, llama, vit

# --- reference counts, from each architecture's published description --------------------------

def _dense(fan_in: int, fan_out: int, bias: bool = True) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def gpt2_xl_count() -> int:
    vocab, context, d, mlp, blocks = 50257, 1024, 1600, 6400, 48
    block = 2 * 2 * d + 4 * _dense(d, d) + _dense(d, mlp) + _dense(mlp, d)  # 2 LNs, q k v o, MLP
    return vocab * d + context * d + blocks * block + 2 * d  # tied head: no extra matrix


def bert_large_count() -> int:
    vocab, positions, types, d, ffn, blocks = 30522, 512, 2, 1024, 4096, 24
    block = 4 * _dense(d, d) + 2 * d + _dense(d, ffn) + _dense(ffn, d) + 2 * d
    return (vocab + positions + types) * d + 2 * d + blocks * block + _dense(d, d)  # + embedding LN, pooler


def llama_7b_count() -> int:
    vocab, d, mlp, blocks = 32000, 4096, 11008, 32
    block = 4 * d * d + 3 * d * mlp + 2 * d  # q k v o, gate up down, two RMSNorms
    return vocab * d + blocks * block + d + d * vocab  # + final norm, untied head


def vit_l16_count() -> int:
    d, mlp, blocks, patch, tokens, classes = 1024, 4096, 24, 16, 14 * 14 + 1, 1000
    block = 2 * 2 * d + 4 * _dense(d, d) + _dense(d, mlp) + _dense(mlp, d)
    return _dense(patch * patch * 3, d) + d + tokens * d + blocks * block + 2 * d + _dense(d, classes)


# name, program builder, entry builder, exact count, published figure, layer names in order
PUBLISHED = {
    "gpt2_xl": (gpt2.gpt2_program, gpt2.gpt2_entry, gpt2_xl_count(), 1_557_611_200,
                ["embed", *(f"block_{i}" for i in range(48)), "head"]),
    "bert_large": (bert.bert_program, bert.bert_entry, bert_large_count(), 336_000_000,
                   ["embed", *(f"block_{i}" for i in range(24)), "pooler"]),
    "llama_7b": (llama.llama_program, llama.llama_entry, llama_7b_count(), 6_738_415_616,
                 ["embed", *(f"block_{i}" for i in range(32)), "final_norm", "head"]),
    "vit_l16": (vit.vit_program, vit.vit_entry, vit_l16_count(), 304_326_632,
                ["embed", *(f"block_{i}" for i in range(24)), "head"]),
}


def _total(program: Program) -> int:
    return sum(math.prod(p.shape) for p in program.parameters)


def test_reference_formulas_give_the_published_exact_counts():
    assert (gpt2_xl_count(), bert_large_count(), llama_7b_count(), vit_l16_count()) == (
        1_557_611_200, 335_141_888, 6_738_415_616, 304_326_632)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_have_the_published_parameter_count(name):
    make_program, _, exact, published, _ = PUBLISHED[name]
    program = make_program()
    assert program.name == name and program.version == "1" and program.kind == "model"
    assert _total(program) == exact
    assert abs(_total(program) - published) / published < 0.01
    assert all(p.dtype == "float32" for p in program.parameters)


@pytest.mark.parametrize("name", PUBLISHED)
def test_layer_tables_have_one_row_per_layer_and_count_every_parameter_once(name):
    _, make_entry, exact, _, layer_names = PUBLISHED[name]
    program = make_entry().program
    assert [layer.name for layer in program.layers] == layer_names
    assert [layer.order for layer in program.layers] == list(range(len(layer_names)))
    owned = [f"{layer.name}/{leaf}" for layer in program.layers for leaf in layer.parameter_shapes]
    assert sorted(owned) == sorted(p.name for p in program.parameters)  # each leaf in exactly one row
    assert sum(layer.parameter_count for layer in program.layers) == exact
    assert all(layer.flops_per_sample > 0 for layer in program.layers if layer.kind == "transformer_block")


def test_gpt2_head_reads_the_token_embedding_it_does_not_own():
    entry = gpt2.gpt2_entry()
    layers = {layer.name: layer for layer in entry.program.layers}
    wte_bytes = 50257 * 1600 * 4
    assert layers["head"].shared_from == "embed"
    assert layers["head"].shared_parameter_bytes == wte_bytes
    assert layers["head"].parameter_count == 2 * 1600  # ln_f only
    assert layers["embed"].parameter_bytes == wte_bytes + 1024 * 1600 * 4
    assert all(not layer.shared_from and not layer.shared_parameter_bytes
               for layer in entry.program.layers if layer.name != "head")
    head_fn = entry.layer_fns[-1]
    assert "embed/wte" in head_fn.param_names and "embed/wpe" not in head_fn.param_names


def test_a_gpt2_xl_block_costs_two_flops_per_weight_per_token_plus_attention():
    layers = {layer.name: layer for layer in gpt2.gpt2_entry().program.layers}
    tokens, d, vocab = 1024, 1600, 50257
    block_params = layers["block_0"].parameter_count
    expected = 2 * block_params * tokens + 2 * 2 * tokens * tokens * d  # dense layers; q.k and weights.v
    assert 0.98 * expected <= layers["block_0"].flops_per_sample <= 1.05 * expected
    assert all(layers[f"block_{i}"].flops_per_sample == layers["block_0"].flops_per_sample for i in range(48))
    assert layers["head"].flops_per_sample == pytest.approx(2 * tokens * d * vocab, rel=0.02)
    assert layers["block_0"].activation_bytes_per_sample == tokens * d * 4


def test_identical_blocks_are_lowered_once():
    traces = []

    def block(p, x):
        traces.append(x.shape)
        return x @ p["w"]

    def init(key):
        return {"w": jax.random.normal(key, (8, 8))}

    net = Network([Layer(f"block_{i}", "dense", init, block) for i in range(5)])
    inputs, outputs = (TensorSpec("x", "float32", (None, 8)),), (OutputSpec("y", "float32", (None, 8)),)
    program = Program("five_blocks", "1", "model", "", net.parameters, inputs, outputs,
                      program_digest("five_blocks", "1", "model", net.parameters, inputs, outputs, (block,)))
    table = describe_layers(program, net.layer_fns())
    assert len(table) == 5 and len(traces) == 1
    assert len({layer.flops_per_sample for layer in table}) == 1


def test_a_shared_leaf_must_belong_to_an_earlier_layer():
    def init(key):
        return {"w": jax.random.normal(key, (4, 4))}

    with pytest.raises(ValueError, match="earlier layer"):
        Network([Layer("head", "dense", init, lambda p, s, x: x, shared_from="embed"),
                 Layer("embed", "dense", init, lambda p, x: x)])
    with pytest.raises(ValueError, match="names no parameter"):
        Network([Layer("embed", "dense", init, lambda p, x: x),
                 Layer("head", "dense", init, lambda p, s, x: x, shared_from="embed/nope")])


# --- tiny configs run for real ------------------------------------------------------------------

TINY = {"gpt2": gpt2.GPT2_TINY, "bert": bert.BERT_TINY, "llama": llama.LLAMA_TINY, "vit": vit.VIT_TINY}
DECODERS = ("gpt2", "llama")
BATCH = 2


class Tiny:
    """A tiny model with random weights. Weights come from numpy rather than init_params: the
    jitted init of even a tiny model takes seconds of XLA CPU compile (Network.init_params is
    tested in test_programs), and one compile of fn serves every test of the model."""

    def __init__(self, model: str):
        make = {"gpt2": gpt2.gpt2_entry, "bert": bert.bert_entry, "llama": llama.llama_entry, "vit": vit.vit_entry}
        self.entry: ProgramEntry = make[model](TINY[model])
        self.program = self.entry.program
        rng = np.random.default_rng(0)
        self.params = [((1.0 if p.name.endswith("scale") else 0.0) + 0.1 * rng.standard_normal(p.shape))
                       .astype(np.float32) for p in self.program.parameters]
        self.fn = jax.jit(self.program.fn)
        spec = self.program.inputs[0]
        shape = tuple(BATCH if d is None else d for d in spec.shape)
        if spec.dtype == "int32":
            self.vocab = TINY[model].vocab
            self.x = rng.integers(0, self.vocab, size=shape, dtype=np.int32)
        else:
            self.x = rng.standard_normal(shape).astype(np.float32)

    def run(self, params=None, x=None) -> np.ndarray:
        (out,) = self.fn(*(self.params if params is None else params), self.x if x is None else x)
        return np.asarray(out)


@pytest.fixture(scope="module")
def tiny():
    built: dict[str, Tiny] = {}

    def get(model: str) -> Tiny:
        if model not in built:
            built[model] = Tiny(model)
        return built[model]

    return get


@pytest.mark.parametrize("model", TINY)
def test_tiny_models_run_and_their_layers_compose_to_the_program(tiny, model):
    t = tiny(model)
    expected = t.run()
    assert expected.shape == tuple(BATCH if d is None else d for d in t.program.outputs[0].shape)
    assert np.all(np.isfinite(expected))
    by_name = dict(zip((p.name for p in t.program.parameters), t.params))

    def composed(by_name, x):
        for layer in t.entry.layer_fns:
            x = layer.apply(*(by_name[n] for n in layer.param_names), x)
        return x

    np.testing.assert_allclose(jax.jit(composed)(by_name, t.x), expected, rtol=1e-5, atol=1e-5)
    assert [f.name for f in t.entry.layer_fns] == [layer.name for layer in t.program.layers]


@pytest.mark.parametrize("model", DECODERS)
def test_decoders_are_causal(tiny, model):
    t = tiny(model)
    position = t.x.shape[1] - 4
    changed = t.x.copy()
    changed[:, position] = (changed[:, position] + 1) % t.vocab
    before, after = t.run(), t.run(x=changed)
    np.testing.assert_allclose(after[:, :position], before[:, :position], rtol=1e-6, atol=1e-6)
    assert not np.allclose(after[:, position:], before[:, position:])


def test_bert_attends_to_later_tokens(tiny):
    t = tiny("bert")
    changed = t.x.copy()
    changed[:, -1] = (changed[:, -1] + 1) % t.vocab
    assert not np.allclose(t.run(x=changed), t.run())  # the pooled [CLS] vector sees the last token


def test_gpt2_logits_are_tied_to_the_token_embedding(tiny):
    t = tiny("gpt2")
    wte = [p.name for p in t.program.parameters].index("embed/wte")
    params = list(t.params)
    params[wte] = params[wte].copy()
    params[wte][5] += 1.0  # moves word 5's logit everywhere, whether or not word 5 is in the input
    before, after = t.run(), t.run(params=params)
    assert not np.allclose(after[..., 5], before[..., 5])
    np.testing.assert_allclose(after[..., 6], before[..., 6], rtol=1e-5, atol=1e-5)
