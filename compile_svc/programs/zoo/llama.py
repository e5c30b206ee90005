"""A Llama-style 7B decoder (Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned
Chat Models"; architecture of "LLaMA: Open and Efficient Foundation Language Models").

Configuration of Llama 2 7B (HF `meta-llama/Llama-2-7b-hf` config.json): vocabulary 32000,
d_model 4096, 32 blocks of 32-head causal attention with rotary position embedding (theta
10000) and a SwiGLU MLP of 11008, RMSNorm (eps 1e-5) before each sublayer and at the end, an
untied LM head, no biases. Published parameter count: 6,738,415,616 (HF model card, "7B").
The program takes 2048 tokens (LLaMA 1's context; Llama 2's 4096 changes no parameter).
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
class LlamaConfig:
    name: str  # program name
    vocab: int
    seq_len: int  # tokens per sample the program takes; rotary positions have no parameters
    d_model: int
    blocks: int
    heads: int
    d_mlp: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


LLAMA_7B = LlamaConfig("llama_7b", vocab=32000, seq_len=2048, d_model=4096, blocks=32, heads=32, d_mlp=11008)
LLAMA_TINY = LlamaConfig("llama_tiny", vocab=89, seq_len=16, d_model=32, blocks=2, heads=4, d_mlp=96)


@functools.cache
def llama_network(cfg: LlamaConfig) -> Network:
    d = cfg.d_model

    def embed_init(key: jax.Array) -> dict[str, Any]:
        return {"tok": c.normal(key, (cfg.vocab, d))}

    def embed(p: dict[str, Any], tokens: jax.Array) -> jax.Array:
        return jnp.take(p["tok"], tokens, axis=0)

    def block_init(key: jax.Array) -> dict[str, Any]:
        k_attn, k_mlp = jax.random.split(key)
        return {"attn_norm": c.rms_norm_init(d), "attn": c.attention_init(k_attn, d, bias=False),
                "mlp_norm": c.rms_norm_init(d), "mlp": c.swiglu_init(k_mlp, d, cfg.d_mlp)}

    def block(p: dict[str, Any], x: jax.Array) -> jax.Array:
        x = x + c.attention(p["attn"], c.rms_norm(p["attn_norm"], x, cfg.norm_eps), cfg.heads, causal=True,
                            rotary_theta=cfg.rope_theta)
        return x + c.swiglu(p["mlp"], c.rms_norm(p["mlp_norm"], x, cfg.norm_eps))

    def norm_init(key: jax.Array) -> dict[str, Any]:
        return c.rms_norm_init(d)

    def norm(p: dict[str, Any], x: jax.Array) -> jax.Array:
        return c.rms_norm(p, x, cfg.norm_eps)

    def head_init(key: jax.Array) -> dict[str, Any]:
        return c.dense_init(key, d, cfg.vocab, bias=False)

    blocks = [Layer(f"block_{i}", "transformer_block", block_init, block) for i in range(cfg.blocks)]
    return Network([Layer("embed", "embedding", embed_init, embed), *blocks,
                    Layer("final_norm", "norm", norm_init, norm), Layer("head", "lm_head", head_init, c.dense)])


def _title(cfg: LlamaConfig) -> str:
    if cfg == LLAMA_7B:
        return "Llama-style 7B, published configuration (Llama 2 7B, HF meta-llama/Llama-2-7b-hf)"
    return "Llama-style decoder"


@functools.cache
def llama_program(cfg: LlamaConfig = LLAMA_7B) -> Program:
    return model_program(
        llama_network(cfg), cfg.name,
        description=(f"{_title(cfg)}: vocab {cfg.vocab}, "
                     f"{cfg.seq_len} tokens, d_model {cfg.d_model}, {cfg.blocks} RMSNorm blocks of {cfg.heads}-head "
                     f"causal attention with rotary positions + SwiGLU MLP {cfg.d_mlp}, untied LM head, no biases"),
        model_input=TensorSpec("tokens", "int32", (None, cfg.seq_len)),
        output=OutputSpec("logits", "float32", (None, cfg.seq_len, cfg.vocab), "concat"),
        code=(llama_network,),
    )


@functools.cache
def llama_entry(cfg: LlamaConfig = LLAMA_7B) -> ProgramEntry:
    return model_entry(llama_program(cfg), llama_network(cfg))
