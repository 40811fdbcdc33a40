"""The dtype the engine computes in: `--dtype auto` (the default) or an explicit one.

On CPUs the choice is about hardware, not memory. With AMX or AVX512-BF16, bfloat16 GEMMs run
several times faster than float32; without them oneDNN emulates bfloat16, orders of magnitude slower
than float32 (the figures, per machine: docs/performance.md, "In bfloat16"). So auto picks bfloat16
on a CPU only where it is native, and only for checkpoints stored in 16 bits or fewer (bf16/fp16 HF
checkpoints, quantized or half GGUF files); a float32 checkpoint stays float32, as with
transformers' dtype="auto".
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("conveyor.dtype")


def cpu_has_native_bf16() -> bool:
    """AMX tiles or AVX512-BF16, as torch's own CPU dispatch probes them."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def cpu_kind() -> str:
    """The CPU's kind for tables of measured kernel choices (engine/load/prepack.py): AMX,
    AVX512_BF16, or torch's own capability name (AVX512, AVX2, DEFAULT, ...) where neither bfloat16
    unit is present."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512_BF16"
    return torch.backends.cpu.get_cpu_capability()


def resolve_dtype(requested: str, declared: str | None, device: torch.device,
                  native_bf16: bool | None = None) -> torch.dtype:
    """requested: --dtype. declared: the checkpoint's torch_dtype (None when it says nothing, read
    as float32). native_bf16: the CPU probe, given by tests."""
    if requested != "auto":
        dtype: torch.dtype = getattr(torch, requested)
        if device.type == "cpu" and dtype != torch.float32 and not _native(native_bf16):
            log.warning("dtype=%s on a CPU without AMX or AVX512-BF16: its GEMMs are emulated, "
                        "about 100x slower than float32; --dtype auto picks float32 here",
                        requested)
        return dtype
    if declared in (None, "float32"):
        return torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if _native(native_bf16) else torch.float32
    return torch.float16 if declared == "float16" else torch.bfloat16


def _native(native_bf16: bool | None) -> bool:
    return cpu_has_native_bf16() if native_bf16 is None else native_bf16
