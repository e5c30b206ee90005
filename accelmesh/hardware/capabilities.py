"""The vocabulary of capability flags: every flag a probe may report and a rule or filter may name.

A name outside this table is a typo, and callers get INVALID_ARGUMENT listing the known names.
"""

CAPABILITIES: dict[str, str] = {
    # Numeric formats with hardware support (matrix units or native vector ops).
    "fp64": "native double precision at a useful rate",
    "fp16": "IEEE half precision arithmetic",
    "bf16": "bfloat16 arithmetic",
    "tf32": "TensorFloat-32 matrix multiply (NVIDIA Ampere and later)",
    "fp8": "8-bit floating point matrix multiply (NVIDIA Ada/Hopper and later)",
    "int8": "8-bit integer matrix multiply",
    "tensor_cores": "NVIDIA tensor cores",
    "matrix_cores": "AMD matrix cores (MFMA)",
    "nvlink": "NVLink peer interconnect",
    # CPU instruction sets, as /proc/cpuinfo names them.
    "fma": "x86 fused multiply-add",
    "avx": "x86 AVX",
    "avx2": "x86 AVX2",
    "avx512f": "x86 AVX-512 foundation",
    "avx512_bf16": "x86 AVX-512 bfloat16 instructions",
    "avx512_fp16": "x86 AVX-512 half precision instructions",
    "avx512_vnni": "x86 AVX-512 vector neural network instructions",
    "avx_vnni": "x86 AVX vector neural network instructions",
    "amx_tile": "x86 Advanced Matrix Extensions tiles",
    "amx_bf16": "x86 AMX bfloat16",
    "amx_int8": "x86 AMX int8",
    "neon": "ARM NEON / ASIMD",
    "sve": "ARM scalable vector extension",
}


def unknown_capabilities(names) -> list[str]:
    return sorted(set(names) - CAPABILITIES.keys())
