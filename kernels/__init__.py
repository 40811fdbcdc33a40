"""Attention backends over the paged KV cache. get_backend picks one; the Triton one imports
lazily."""
from __future__ import annotations

import torch

from kernels.backend import AttentionBackend, BatchLayout

__all__ = ["AttentionBackend", "BatchLayout", "get_backend"]


def get_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32,
                deterministic: bool = False) -> AttentionBackend:
    """name: auto | cpu | torch | triton. auto = Triton on CUDA, cpu elsewhere. cpu = the torch
    backend with the native CPU kernel for decodes and short queries (PyTorch ops where it cannot be
    built); torch = PyTorch ops only, the reference. deterministic: prompt chunks on the native
    kernel too, wherever it runs (one kernel for every row: docs/determinism.md)."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name in ("cpu", "torch"):
        from kernels.torch_backend import TorchBackend

        # The native kernel computes in float32 from float32 or bfloat16 inputs; float16 takes
        # PyTorch ops.
        native = name == "cpu" and dtype in (torch.float32, torch.bfloat16)
        return TorchBackend(device, native=native, dtype=dtype,
                            native_prompts=True if deterministic else None)
    if name == "triton":
        from kernels.triton_backend import TritonBackend

        return TritonBackend(device)
    raise ValueError(f"unknown attention backend {name!r}: expected auto, cpu, torch or triton")


def one_attention_kernel(backend: AttentionBackend) -> bool:
    """Whether every row of a step (a decode, a prompt chunk, a row over a cached prefix) attends
    through one kernel in one fixed order of its context, as --deterministic needs: the native CPU
    kernel with prompts on it (docs/determinism.md). Triton's decode and prefill kernels are two."""
    return bool(getattr(backend, "native", False) and getattr(backend, "native_prompts", False))
