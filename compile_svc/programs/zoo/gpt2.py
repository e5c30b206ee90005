"""GPT-2 XL (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Configuration from the released checkpoint (HF `gpt2-xl` config.json): vocabulary 50257,
context 1024, d_model 1600, 48 pre-LN blocks of 25-head attention and a tanh-GELU MLP of 6400,
a final LayerNorm, and an LM head tied to the token embedding. Published parameter count:
1,557,611,200 (HF `gpt2-xl`, `model.num_parameters()`; the paper rounds to 1542M).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from accelmesh.programs import OutputSpec, Program, TensorSpec
from compile_svc.programs.layers import ProgramEntry
from compile_svc.programs.network import Layer, Network
from compile_svc.programs.zoo import components as c
from compile_svc.programs.zoo.entries import model_entry, model_program


@dataclass(frozen=True)
class Gpt2Config:
    name: str  # program name
    vocab: int
    context: int  # tokens per sample: the program's input width and the learned positions
    d_model: int
    blocks: int
    heads: int
    d_mlp: int
    ln_eps: float = 1e-5


GPT2_XL = Gpt2Config("gpt2_xl", vocab=50257, context=1024, d_model=1600, blocks=48, heads=25, d_mlp=6400)
GPT2_TINY = Gpt2Config("gpt2_tiny", vocab=97, context=16, d_model=32, blocks=2, heads=4, d_mlp=128)


@functools.cache
def gpt2_network(cfg: Gpt2Config) -> Network:
    d = cfg.d_model

    def embed_init(key: jax.Array) -> dict[str, Any]:
        k_tok, k_pos = jax.random.split(key)
        return {"wte": c.normal(k_tok, (cfg.vocab, d)), "wpe": c.normal(k_pos, (cfg.context, d), 0.01)}

    def embed(p: dict[str, Any], tokens: jax.Array) -> jax.Array:
        return jnp.take(p["wte"], tokens, axis=0) + p["wpe"][: tokens.shape[-1]]

    def block_init(key: jax.Array) -> dict[str, Any]:
        k_attn, k_mlp = jax.random.split(key)
        return {"ln_1": c.layer_norm_init(d), "attn": c.attention_init(k_attn, d, bias=True),
                "ln_2": c.layer_norm_init(d), "mlp": c.gelu_mlp_init(k_mlp, d, cfg.d_mlp)}

    def block(p: dict[str, Any], x: jax.Array) -> jax.Array:
        x = x + c.attention(p["attn"], c.layer_norm(p["ln_1"], x, cfg.ln_eps), cfg.heads, causal=True)
        return x + c.gelu_mlp(p["mlp"], c.layer_norm(p["ln_2"], x, cfg.ln_eps), approximate=True)

    def head_init(key: jax.Array) -> dict[str, Any]:
        return {"ln_f": c.layer_norm_init(d)}

    def head(p: dict[str, Any], shared: dict[str, Any], x: jax.Array) -> jax.Array:
        return c.layer_norm(p["ln_f"], x, cfg.ln_eps) @ shared["wte"].T

    blocks = [Layer(f"block_{i}", "transformer_block", block_init, block) for i in range(cfg.blocks)]
    return Network([Layer("embed", "embedding", embed_init, embed), *blocks,
                    Layer("head", "lm_head", head_init, head, shared_from="embed/wte")])


def _title(cfg: Gpt2Config) -> str:
    if cfg == GPT2_XL:
        return "GPT-2 XL, published configuration (HF gpt2-xl)"
    return "GPT-2 decoder"


@functools.cache
def gpt2_program(cfg: Gpt2Config = GPT2_XL) -> Program:
    return model_program(
        gpt2_network(cfg), cfg.name,
        description=(f"{_title(cfg)}: vocab {cfg.vocab}, context "
                     f"{cfg.context}, d_model {cfg.d_model}, {cfg.blocks} pre-LN blocks of {cfg.heads}-head causal "
                     f"attention + GELU MLP {cfg.d_mlp}, final LN, LM head tied to the token embedding"),
        model_input=TensorSpec("tokens", "int32", (None, cfg.context)),
        output=OutputSpec("logits", "float32", (None, cfg.context, cfg.vocab), "concat"),
        code=(gpt2_network,),
    )


@functools.cache
def gpt2_entry(cfg: Gpt2Config = GPT2_XL) -> ProgramEntry:
    return model_entry(gpt2_program(cfg), gpt2_network(cfg))
