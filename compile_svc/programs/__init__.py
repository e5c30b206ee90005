"""The program registry: built-in networks, the model zoo, plugins, uploads, their signatures and layer tables."""

from compile_svc.programs.layers import DeferredEntry, LayerFn, ProgramEntry, describe_layers
from compile_svc.programs.params_io import load_params, save_params
from compile_svc.programs.registry import ENTRY_POINT_GROUP, ProgramRegistry, default_registry
from compile_svc.programs.signature import check_signature, program_digest
from compile_svc.programs.uploaded import program_from_export

__all__ = [
    "ENTRY_POINT_GROUP", "DeferredEntry", "LayerFn", "ProgramEntry", "ProgramRegistry", "check_signature",
    "default_registry", "describe_layers", "load_params", "program_digest", "program_from_export", "save_params",
]
