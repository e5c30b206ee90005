"""The 8x8-digits MLP (64 -> 128 -> 128 -> 10) as a classifier and as a training step."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from accelmesh.programs import OutputSpec, Program, TensorSpec
from compile_svc.programs import network, pytrees
from compile_svc.programs.layers import ProgramEntry, describe_layers
from compile_svc.programs.network import Layer, Network
from compile_svc.programs.signature import program_digest

INPUT_FEATURES = 64  # an 8x8 digit image, flattened
HIDDEN = 128
CLASSES = 10
VERSION = "1"
CODE = (network, pytrees)  # modules whose source enters the digest besides this one


def _dense(fan_in: int, fan_out: int):
    def init(key: jax.Array) -> dict[str, Any]:
        # He init keeps relu activations at unit scale, so the untrained net gives finite, varied logits.
        w = jax.random.normal(key, (fan_in, fan_out), jnp.float32) * jnp.sqrt(2.0 / fan_in)
        return {"w": w, "b": jnp.zeros((fan_out,), jnp.float32)}
    return init


def _relu_dense(p: dict[str, Any], x: jax.Array) -> jax.Array:
    return jax.nn.relu(x @ p["w"] + p["b"])


def _linear(p: dict[str, Any], x: jax.Array) -> jax.Array:
    return x @ p["w"] + p["b"]


@functools.cache
def mlp_network() -> Network:
    return Network([
        Layer("dense_0", "dense", _dense(INPUT_FEATURES, HIDDEN), _relu_dense),
        Layer("dense_1", "dense", _dense(HIDDEN, HIDDEN), _relu_dense),
        Layer("head", "dense", _dense(HIDDEN, CLASSES), _linear),
    ])


@functools.cache
def mlp_classifier() -> ProgramEntry:
    net = mlp_network()

    def fn(*args: Any) -> tuple[jax.Array]:
        *leaves, x = args
        return (net.apply(leaves, x),)

    inputs = (TensorSpec("x", "float32", (None, INPUT_FEATURES)),)
    outputs = (OutputSpec("logits", "float32", (None, CLASSES), "concat"),)
    program = Program(
        name="mlp_classifier", version=VERSION, kind="model",
        description="MLP on 8x8 digits: 64 -> 128 relu -> 128 relu -> 10 logits",
        parameters=net.parameters, inputs=inputs, outputs=outputs,
        digest=program_digest("mlp_classifier", VERSION, "model", net.parameters, inputs, outputs, (fn, *CODE)),
        fn=fn, init_params=net.init_params,
    )
    layer_fns = net.layer_fns()
    return ProgramEntry(dataclasses.replace(program, layers=describe_layers(program, layer_fns)), layer_fns)


@functools.cache
def mlp_train_step() -> ProgramEntry:
    """Gradients of the MEAN loss over the shard: the shard-size-weighted mean of shard
    gradients is then exactly the full-batch gradient, which is how dispatch combines them."""
    net = mlp_network()

    def fn(*args: Any) -> tuple[jax.Array, ...]:
        *leaves, x, y = args

        def loss_fn(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
            logits = net.apply(leaves, x)
            log_probs = jax.nn.log_softmax(logits)
            nll = -jnp.take_along_axis(log_probs, y[:, None], axis=1)[:, 0]
            return jnp.mean(nll), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(list(leaves))
        correct = jnp.sum(jnp.argmax(logits, axis=-1) == y).astype(jnp.int32)
        return (*grads, loss, correct)

    inputs = (TensorSpec("x", "float32", (None, INPUT_FEATURES)), TensorSpec("y", "int32", (None,)))
    outputs = (
        *(OutputSpec(f"grad/{p.name}", p.dtype, p.shape, "mean") for p in net.parameters),
        OutputSpec("loss", "float32", (), "mean"),
        OutputSpec("correct", "int32", (), "sum"),
    )
    program = Program(
        name="mlp_train_step", version=VERSION, kind="training_step",
        description="One training step of mlp_classifier: mean cross-entropy gradients, loss, correct count",
        parameters=net.parameters, inputs=inputs, outputs=outputs,
        digest=program_digest("mlp_train_step", VERSION, "training_step", net.parameters, inputs, outputs,
                              (fn, *CODE)),
        fn=fn, init_params=net.init_params,
        # The layer table describes the model being trained; it is the classifier's table.
        layers=mlp_classifier().program.layers,
    )
    # No stages: a training step does not decompose into forward layers.
    return ProgramEntry(program)
