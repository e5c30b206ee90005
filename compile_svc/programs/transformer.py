"""A small pre-LN transformer encoder classifier: 32 tokens of a 512-word vocabulary -> 16 classes.

Attention is written with plain jnp: fused helpers such as jax.nn.dot_product_attention pick
cuDNN and fail to trace for a cuda target on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from accelmesh.programs import OutputSpec, Program, TensorSpec
from compile_svc.programs import network, pytrees
from compile_svc.programs.layers import ProgramEntry, describe_layers
from compile_svc.programs.network import Layer, Network
from compile_svc.programs.signature import program_digest

VOCAB = 512
SEQ_LEN = 32
D_MODEL = 128
HEADS = 4
D_MLP = 512
BLOCKS = 4
CLASSES = 16
LN_EPS = 1e-5
VERSION = "1"


def _normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)


def _ln_init() -> dict[str, jax.Array]:
    return {"scale": jnp.ones((D_MODEL,), jnp.float32), "bias": jnp.zeros((D_MODEL,), jnp.float32)}


def _layer_norm(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LN_EPS) * p["scale"] + p["bias"]


def _embed_init(key: jax.Array) -> dict[str, Any]:
    k_tok, k_pos = jax.random.split(key)
    return {"tok": 0.02 * jax.random.normal(k_tok, (VOCAB, D_MODEL), jnp.float32),
            "pos": 0.02 * jax.random.normal(k_pos, (SEQ_LEN, D_MODEL), jnp.float32)}


def _embed(p: dict[str, Any], tokens: jax.Array) -> jax.Array:
    return jnp.take(p["tok"], tokens, axis=0) + p["pos"]


def _block_init(key: jax.Array) -> dict[str, Any]:
    kq, kk, kv, ko, k_in, k_out = jax.random.split(key, 6)
    return {
        "ln_1": _ln_init(),
        "attn": {"wq": _normal(kq, (D_MODEL, D_MODEL), D_MODEL), "wk": _normal(kk, (D_MODEL, D_MODEL), D_MODEL),
                 "wv": _normal(kv, (D_MODEL, D_MODEL), D_MODEL), "wo": _normal(ko, (D_MODEL, D_MODEL), D_MODEL)},
        "ln_2": _ln_init(),
        "mlp": {"w_in": _normal(k_in, (D_MODEL, D_MLP), D_MODEL), "b_in": jnp.zeros((D_MLP,), jnp.float32),
                "w_out": _normal(k_out, (D_MLP, D_MODEL), D_MLP), "b_out": jnp.zeros((D_MODEL,), jnp.float32)},
    }


def _attention(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    head_dim = D_MODEL // HEADS

    def heads(t: jax.Array) -> jax.Array:  # [batch, tokens, d_model] -> [batch, tokens, heads, head_dim]
        return t.reshape(*t.shape[:-1], HEADS, head_dim)

    q, k, v = heads(x @ p["wq"]), heads(x @ p["wk"]), heads(x @ p["wv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(*x.shape) @ p["wo"]


def _block(p: dict[str, Any], x: jax.Array) -> jax.Array:
    x = x + _attention(p["attn"], _layer_norm(p["ln_1"], x))
    h = jax.nn.gelu(_layer_norm(p["ln_2"], x) @ p["mlp"]["w_in"] + p["mlp"]["b_in"])
    return x + h @ p["mlp"]["w_out"] + p["mlp"]["b_out"]


def _head_init(key: jax.Array) -> dict[str, Any]:
    return {"ln": _ln_init(), "w": _normal(key, (D_MODEL, CLASSES), D_MODEL),
            "b": jnp.zeros((CLASSES,), jnp.float32)}


def _head(p: dict[str, Any], x: jax.Array) -> jax.Array:
    pooled = jnp.mean(_layer_norm(p["ln"], x), axis=1)
    return pooled @ p["w"] + p["b"]


@functools.cache
def transformer_network() -> Network:
    blocks = [Layer(f"block_{i}", "transformer_block", _block_init, _block) for i in range(BLOCKS)]
    return Network([Layer("embed", "embedding", _embed_init, _embed), *blocks,
                    Layer("head", "classifier_head", _head_init, _head)])


@functools.cache
def transformer_encoder() -> ProgramEntry:
    net = transformer_network()

    def fn(*args: Any) -> tuple[jax.Array]:
        *leaves, tokens = args
        return (net.apply(leaves, tokens),)

    inputs = (TensorSpec("tokens", "int32", (None, SEQ_LEN)),)
    outputs = (OutputSpec("logits", "float32", (None, CLASSES), "concat"),)
    program = Program(
        name="transformer_encoder", version=VERSION, kind="model",
        description=(f"Pre-LN transformer encoder: vocab {VOCAB}, {SEQ_LEN} tokens, d_model {D_MODEL}, "
                     f"{BLOCKS} blocks of {HEADS}-head attention + GELU MLP {D_MLP}, mean pool, {CLASSES} classes"),
        parameters=net.parameters, inputs=inputs, outputs=outputs,
        digest=program_digest("transformer_encoder", VERSION, "model", net.parameters, inputs, outputs,
                              (fn, network, pytrees)),
        fn=fn, init_params=net.init_params,
    )
    layer_fns = net.layer_fns()
    return ProgramEntry(dataclasses.replace(program, layers=describe_layers(program, layer_fns)), layer_fns)
