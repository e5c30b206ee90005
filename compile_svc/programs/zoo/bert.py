"""BERT-large, uncased (Devlin et al. 2018, "BERT: Pre-training of Deep Bidirectional
Transformers for Language Understanding").

Configuration from the released checkpoint (HF `bert-large-uncased` config.json): vocabulary
30522, 512 positions, 2 token types, d_model 1024, 24 post-LN blocks of 16-head attention and
an erf-GELU FFN of 4096, and the pooler (dense + tanh on [CLS]). Published size: "336M" (HF
pretrained-models table), 340M in the paper; the exact count with the pooler is 335,141,888.

The program is the encoder with its pooler and no task head, so it returns the pooled [CLS]
vector. Every token is segment A (token type 0) and attends to every other token (no padding).
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
class BertConfig:
    name: str  # program name
    vocab: int
    positions: int  # learned positions, and the tokens per sample the program takes
    token_types: int
    d_model: int
    blocks: int
    heads: int
    d_ffn: int
    ln_eps: float = 1e-12


BERT_LARGE = BertConfig("bert_large", vocab=30522, positions=512, token_types=2, d_model=1024, blocks=24, heads=16,
                        d_ffn=4096)
BERT_TINY = BertConfig("bert_tiny", vocab=101, positions=16, token_types=2, d_model=32, blocks=2, heads=4, d_ffn=64)


@functools.cache
def bert_network(cfg: BertConfig) -> Network:
    d = cfg.d_model

    def embed_init(key: jax.Array) -> dict[str, Any]:
        k_word, k_pos, k_type = jax.random.split(key, 3)
        return {"word": c.normal(k_word, (cfg.vocab, d)), "position": c.normal(k_pos, (cfg.positions, d)),
                "token_type": c.normal(k_type, (cfg.token_types, d)), "ln": c.layer_norm_init(d)}

    def embed(p: dict[str, Any], tokens: jax.Array) -> jax.Array:
        x = jnp.take(p["word"], tokens, axis=0) + p["position"][: tokens.shape[-1]] + p["token_type"][0]
        return c.layer_norm(p["ln"], x, cfg.ln_eps)

    def block_init(key: jax.Array) -> dict[str, Any]:
        k_attn, k_ffn = jax.random.split(key)
        return {"attn": c.attention_init(k_attn, d, bias=True), "ln_attn": c.layer_norm_init(d),
                "ffn": c.gelu_mlp_init(k_ffn, d, cfg.d_ffn), "ln_ffn": c.layer_norm_init(d)}

    def block(p: dict[str, Any], x: jax.Array) -> jax.Array:
        x = c.layer_norm(p["ln_attn"], x + c.attention(p["attn"], x, cfg.heads), cfg.ln_eps)
        return c.layer_norm(p["ln_ffn"], x + c.gelu_mlp(p["ffn"], x, approximate=False), cfg.ln_eps)

    def pooler_init(key: jax.Array) -> dict[str, Any]:
        return {"dense": c.dense_init(key, d, d)}

    def pooler(p: dict[str, Any], x: jax.Array) -> jax.Array:
        return jnp.tanh(c.dense(p["dense"], x[:, 0]))

    blocks = [Layer(f"block_{i}", "transformer_block", block_init, block) for i in range(cfg.blocks)]
    return Network([Layer("embed", "embedding", embed_init, embed), *blocks,
                    Layer("pooler", "pooler", pooler_init, pooler)])


def _title(cfg: BertConfig) -> str:
    if cfg == BERT_LARGE:
        return "BERT-large uncased, published configuration (HF bert-large-uncased)"
    return "BERT encoder"


@functools.cache
def bert_program(cfg: BertConfig = BERT_LARGE) -> Program:
    return model_program(
        bert_network(cfg), cfg.name,
        description=(f"{_title(cfg)}: vocab {cfg.vocab}, "
                     f"{cfg.positions} positions, {cfg.token_types} token types, d_model {cfg.d_model}, "
                     f"{cfg.blocks} post-LN blocks of {cfg.heads}-head attention + GELU FFN {cfg.d_ffn}, "
                     "tanh pooler on [CLS]; returns the pooled vector"),
        model_input=TensorSpec("tokens", "int32", (None, cfg.positions)),
        output=OutputSpec("pooled", "float32", (None, cfg.d_model), "concat"),
        code=(bert_network,),
    )


@functools.cache
def bert_entry(cfg: BertConfig = BERT_LARGE) -> ProgramEntry:
    return model_entry(bert_program(cfg), bert_network(cfg))
