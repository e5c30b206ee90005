"""ViT-L/16 (Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words: Transformers for Image
Recognition at Scale").

Configuration of timm `vit_large_patch16_224`: 224x224x3 images cut into 16x16 patches (the
patch convolution written as a reshape + dense), a class token, 197 learned positions, 24
pre-LN blocks of d_model 1024 with 16-head attention and an erf-GELU MLP of 4096, a final LN
and a 1000-class head on the class token. Published parameter count: 304,326,632 (timm
`vit_large_patch16_224`); the paper's Table 1 rounds to 307M.
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
class VitConfig:
    name: str  # program name
    image: int  # height = width, pixels
    channels: int
    patch: int
    d_model: int
    blocks: int
    heads: int
    d_mlp: int
    classes: int
    ln_eps: float = 1e-6

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2


VIT_L16 = VitConfig("vit_l16", image=224, channels=3, patch=16, d_model=1024, blocks=24, heads=16, d_mlp=4096,
                    classes=1000)
VIT_TINY = VitConfig("vit_tiny", image=32, channels=3, patch=8, d_model=32, blocks=2, heads=4, d_mlp=64, classes=10)


@functools.cache
def vit_network(cfg: VitConfig) -> Network:
    d, side = cfg.d_model, cfg.image // cfg.patch
    patch_features = cfg.patch * cfg.patch * cfg.channels

    def embed_init(key: jax.Array) -> dict[str, Any]:
        k_patch, k_cls, k_pos = jax.random.split(key, 3)
        return {"patch": c.dense_init(k_patch, patch_features, d), "cls": c.normal(k_cls, (d,), 1e-6),
                "pos": c.normal(k_pos, (cfg.patches + 1, d))}

    def embed(p: dict[str, Any], images: jax.Array) -> jax.Array:
        batch = images.shape[0]
        # [b, H, W, C] -> [b, side, patch, side, patch, C] -> [b, side, side, patch, patch, C]: row-major
        # patches, each flattened as the conv kernel [patch, patch, C] would read it.
        grid = images.reshape(batch, side, cfg.patch, side, cfg.patch, cfg.channels).transpose(0, 1, 3, 2, 4, 5)
        tokens = c.dense(p["patch"], grid.reshape(batch, cfg.patches, patch_features))
        cls = jnp.broadcast_to(p["cls"], (batch, 1, d)).astype(tokens.dtype)
        return jnp.concatenate([cls, tokens], axis=1) + p["pos"]

    def block_init(key: jax.Array) -> dict[str, Any]:
        k_attn, k_mlp = jax.random.split(key)
        return {"ln_1": c.layer_norm_init(d), "attn": c.attention_init(k_attn, d, bias=True),
                "ln_2": c.layer_norm_init(d), "mlp": c.gelu_mlp_init(k_mlp, d, cfg.d_mlp)}

    def block(p: dict[str, Any], x: jax.Array) -> jax.Array:
        x = x + c.attention(p["attn"], c.layer_norm(p["ln_1"], x, cfg.ln_eps), cfg.heads)
        return x + c.gelu_mlp(p["mlp"], c.layer_norm(p["ln_2"], x, cfg.ln_eps), approximate=False)

    def head_init(key: jax.Array) -> dict[str, Any]:
        return {"ln": c.layer_norm_init(d), "fc": c.dense_init(key, d, cfg.classes)}

    def head(p: dict[str, Any], x: jax.Array) -> jax.Array:
        return c.dense(p["fc"], c.layer_norm(p["ln"], x[:, 0], cfg.ln_eps))

    blocks = [Layer(f"block_{i}", "transformer_block", block_init, block) for i in range(cfg.blocks)]
    return Network([Layer("embed", "patch_embedding", embed_init, embed), *blocks,
                    Layer("head", "classifier_head", head_init, head)])


def _title(cfg: VitConfig) -> str:
    if cfg == VIT_L16:
        return "ViT-L/16, published configuration (timm vit_large_patch16_224)"
    return "Vision transformer"


@functools.cache
def vit_program(cfg: VitConfig = VIT_L16) -> Program:
    return model_program(
        vit_network(cfg), cfg.name,
        description=(f"{_title(cfg)}: "
                     f"{cfg.image}x{cfg.image}x{cfg.channels} images, {cfg.patch}x{cfg.patch} patches + class token, "
                     f"d_model {cfg.d_model}, {cfg.blocks} pre-LN blocks of {cfg.heads}-head attention + GELU MLP "
                     f"{cfg.d_mlp}, final LN, {cfg.classes}-class head on the class token"),
        model_input=TensorSpec("images", "float32", (None, cfg.image, cfg.image, cfg.channels)),
        output=OutputSpec("logits", "float32", (None, cfg.classes), "concat"),
        code=(vit_network,),
    )


@functools.cache
def vit_entry(cfg: VitConfig = VIT_L16) -> ProgramEntry:
    return model_entry(vit_program(cfg), vit_network(cfg))
