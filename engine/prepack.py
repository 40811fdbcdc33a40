"""Projection weights laid out once for oneDNN, so no GEMM reorders them again at every call.

torch's F.linear hands oneDNN (or MKL) a plain row-major matrix, and the library repacks it into its
blocked layout inside each call: for a decode step, where every weight is read once for a few rows,
that repacking is a large part of the GEMM. `torch.ops.mkldnn._reorder_linear_weight` does it once at
load (what inductor's freezing pass does for compiled CPU models); `_linear_pointwise` then multiplies
with the packed matrix, and its `.binary` form adds the residual inside the GEMM as addmm did. The
figures: docs/performance.md, "Prepacked weights".

Only plain nn.Linear projections of a CPU model in float32 or bfloat16 are packed; quantized ones
(engine/quant.py) and MoE experts keep their own kernels. A tied LM head gets a packed copy of the
embedding matrix (the embedding itself stays a lookup table).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

log = logging.getLogger("conveyor.prepack")
PACKABLE = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """y = x @ W.T (+ b) with W in oneDNN's blocked layout (an opaque mkldnn tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)  # a buffer, so the model's size counts it
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h + x @ W.T (+ b), the addition fused into the GEMM."""
        if self.bias is not None:
            out: torch.Tensor = h + self(x)
            return out
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, h, self.packed, None, "add")
        return y


def usable(model: nn.Module, device: torch.device) -> bool:
    """Whether this torch, device and dtype can take packed weights. oneDNN packs bfloat16 only on CPUs
    with bfloat16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere (AVX2 alone) the reorder
    raises, and bfloat16 stays on F.linear."""
    dtype = next(model.parameters()).dtype
    if device.type != "cpu" or dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_model(model: LlamaForCausalLM, projections: tuple[str, ...]) -> int:
    """Replaces each decoder layer's plain projections and the LM head in place. -> matrices packed."""
    packed = 0
    for layer in model.model.layers:
        for name in projections:
            proj = getattr(layer, name, None)
            if isinstance(proj, nn.Linear):
                setattr(layer, name, PackedLinear(proj.weight, proj.bias))
                packed += 1
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    if isinstance(head, (nn.Linear, nn.Embedding)):
        model.lm_head = PackedLinear(head.weight, None)  # type: ignore[assignment]
        packed += 1
    log.info("%d weight matrices prepacked for oneDNN", packed)
    return packed
