"""Attention backends over the paged KV cache. get_backend picks one; the Triton one imports lazily."""
from __future__ import annotations

import torch

from kernels.backend import AttentionBackend, BatchLayout

__all__ = ["AttentionBackend", "BatchLayout", "get_backend"]


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """name: auto | torch | triton. auto = Triton on CUDA, PyTorch elsewhere."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from kernels.torch_backend import TorchBackend

        return TorchBackend(device)
    if name == "triton":
        from kernels.triton_backend import TritonBackend

        return TritonBackend(device)
    raise ValueError(f"unknown attention backend {name!r}: expected auto, torch or triton")
