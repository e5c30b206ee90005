"""The programs every compile service ships with."""

from __future__ import annotations

import functools

import jax

from accelmesh.programs import OutputSpec, Program, TensorSpec
from compile_svc.programs.layers import DeferredEntry, ProgramEntry
from compile_svc.programs.mlp import mlp_classifier, mlp_train_step
from compile_svc.programs.signature import program_digest
from compile_svc.programs.transformer import transformer_encoder
from compile_svc.programs.zoo import bert, gpt2, llama, vit
from compile_svc.programs.zoo.entries import VERSION as ZOO_VERSION

IDENTITY_WIDTH = 1024  # 4 KiB float32 rows: streaming benchmarks size payloads in whole rows


def _identity_fn(x: jax.Array) -> tuple[jax.Array]:
    return (x,)


@functools.cache
def identity() -> ProgramEntry:
    inputs = (TensorSpec("x", "float32", (None, IDENTITY_WIDTH)),)
    outputs = (OutputSpec("y", "float32", (None, IDENTITY_WIDTH), "concat"),)
    return ProgramEntry(Program(
        name="identity", version="1", kind="function",
        description="Returns its input; measures transport, not compute",
        parameters=(), inputs=inputs, outputs=outputs,
        digest=program_digest("identity", "1", "function", (), inputs, outputs, (_identity_fn,)),
        fn=_identity_fn,
    ))


def builtin_entries() -> list[ProgramEntry]:
    """Built lazily and cached: the layer tables lower every layer once per process."""
    return [identity(), mlp_classifier(), mlp_train_step(), transformer_encoder()]


def builtin_deferred() -> list[DeferredEntry]:
    """The model zoo at published sizes, for planning: each costs ~0.1-0.3 s to build (abstract
    shapes only, no weights), too much for every compile service's start-up."""
    return [
        DeferredEntry(gpt2.GPT2_XL.name, ZOO_VERSION, gpt2.gpt2_program, gpt2.gpt2_entry),
        DeferredEntry(bert.BERT_LARGE.name, ZOO_VERSION, bert.bert_program, bert.bert_entry),
        DeferredEntry(llama.LLAMA_7B.name, ZOO_VERSION, llama.llama_program, llama.llama_entry),
        DeferredEntry(vit.VIT_L16.name, ZOO_VERSION, vit.vit_program, vit.vit_entry),
    ]
