"""Building blocks of the zoo's transformers: initialisers, norms, attention, MLPs, rotary.

Parameters are float32 (rules choose the compute dtype). Attention is plain jnp: fused helpers
such as jax.nn.dot_product_attention pick cuDNN and fail to trace for a cuda target on a
machine without a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

INIT_STD = 0.02  # GPT-2, BERT, ViT and Llama all initialise weights from N(0, 0.02)

Params = dict[str, Any]


def normal(key: jax.Array, shape: tuple[int, ...], std: float = INIT_STD) -> jax.Array:
    return std * jax.random.normal(key, shape, jnp.float32)


def dense_init(key: jax.Array, fan_in: int, fan_out: int, bias: bool = True) -> Params:
    p = {"w": normal(key, (fan_in, fan_out))}
    if bias:
        p["b"] = jnp.zeros((fan_out,), jnp.float32)
    return p


def dense(p: Params, x: jax.Array) -> jax.Array:
    y = x @ p["w"]
    return y + p["b"] if "b" in p else y


def layer_norm_init(d: int) -> Params:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def layer_norm(p: Params, x: jax.Array, eps: float) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def rms_norm_init(d: int) -> Params:
    return {"scale": jnp.ones((d,), jnp.float32)}


def rms_norm(p: Params, x: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * p["scale"]


def attention_init(key: jax.Array, d: int, bias: bool) -> Params:
    kq, kk, kv, ko = jax.random.split(key, 4)
    return {name: dense_init(k, d, d, bias) for name, k in (("q", kq), ("k", kk), ("v", kv), ("o", ko))}


def attention(p: Params, x: jax.Array, heads: int, *, causal: bool = False,
              rotary_theta: float | None = None) -> jax.Array:
    """Multi-head self-attention over x [batch, tokens, d]; rotary_theta set = RoPE on q and k."""
    tokens, d = x.shape[-2], x.shape[-1]
    head_dim = d // heads

    def split(t: jax.Array) -> jax.Array:  # [batch, tokens, d] -> [batch, tokens, heads, head_dim]
        return t.reshape(*t.shape[:-1], heads, head_dim)

    q, k, v = split(dense(p["q"], x)), split(dense(p["k"], x)), split(dense(p["v"], x))
    if rotary_theta is not None:
        q, k = rotary(q, rotary_theta), rotary(k, rotary_theta)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    if causal:
        allowed = jnp.tril(jnp.ones((tokens, tokens), bool))
        scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return dense(p["o"], out.reshape(x.shape))


def rotary(t: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of t [batch, tokens, heads, head_dim], Llama's half-split layout."""
    tokens, head_dim = t.shape[1], t.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(tokens, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [tokens, head_dim / 2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # broadcast over heads
    first, second = t[..., : head_dim // 2], t[..., head_dim // 2:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(t.dtype)


def gelu_mlp_init(key: jax.Array, d: int, hidden: int) -> Params:
    k_in, k_out = jax.random.split(key)
    return {"fc_in": dense_init(k_in, d, hidden), "fc_out": dense_init(k_out, hidden, d)}


def gelu_mlp(p: Params, x: jax.Array, approximate: bool) -> jax.Array:
    """approximate: GPT-2's tanh GELU; BERT and ViT use the exact erf form."""
    return dense(p["fc_out"], jax.nn.gelu(dense(p["fc_in"], x), approximate=approximate))


def swiglu_init(key: jax.Array, d: int, hidden: int) -> Params:
    k_gate, k_up, k_down = jax.random.split(key, 3)
    return {"gate": dense_init(k_gate, d, hidden, bias=False), "up": dense_init(k_up, d, hidden, bias=False),
            "down": dense_init(k_down, hidden, d, bias=False)}


def swiglu(p: Params, x: jax.Array) -> jax.Array:
    return dense(p["down"], jax.nn.silu(dense(p["gate"], x)) * dense(p["up"], x))
