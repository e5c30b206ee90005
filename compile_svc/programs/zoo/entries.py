"""A zoo network as a registered model program: signature and digest first, layer table after.

The two steps are apart because they cost differently: the program needs one abstract trace of
init, the layer table lowers every distinct layer (seconds for a 7B model), so a registry can
list a model long before anyone asks for its table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax

from accelmesh.programs import OutputSpec, Program, TensorSpec
from compile_svc.programs import network, pytrees
from compile_svc.programs.layers import ProgramEntry, describe_layers
from compile_svc.programs.network import Network
from compile_svc.programs.signature import program_digest
from compile_svc.programs.zoo import components

VERSION = "1"
KIND = "model"


def model_program(net: Network, name: str, description: str, model_input: TensorSpec, output: OutputSpec,
                  code: Iterable[object]) -> Program:
    """The whole-model program of `net`, without its layer table.

    code: the modules defining the model (their source enters the digest with the shared ones).
    """

    def fn(*args: Any) -> tuple[jax.Array]:
        *leaves, x = args
        return (net.apply(leaves, x),)

    inputs, outputs = (model_input,), (output,)
    modules = (*code, network, pytrees, components)
    return Program(
        name=name, version=VERSION, kind=KIND, description=description,
        parameters=net.parameters, inputs=inputs, outputs=outputs,
        digest=program_digest(name, VERSION, KIND, net.parameters, inputs, outputs, modules),
        fn=fn, init_params=net.init_params,
    )


def model_entry(program: Program, net: Network) -> ProgramEntry:
    """The program with its layer table and pipeline stages."""
    layer_fns = net.layer_fns()
    return ProgramEntry(dataclasses.replace(program, layers=describe_layers(program, layer_fns)), layer_fns)
