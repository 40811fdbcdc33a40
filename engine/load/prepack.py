"""Projection weights laid out once for oneDNN, so no GEMM reorders them again at every call.

torch's F.linear hands oneDNN (or MKL) a plain row-major matrix, and the library repacks it into its
blocked layout inside each call: for a decode step, where every weight is read once for a few rows,
that repacking is a large part of the GEMM. `torch.ops.mkldnn._reorder_linear_weight` does it once
at load (what inductor's freezing pass does for compiled CPU models); `_linear_pointwise` then
multiplies with the packed matrix, and its `.binary` form adds the residual inside the GEMM as addmm
did. The figures: docs/performance.md, "Prepacked weights".

In float32 on CPUs where it was measured (PLAIN_FROM_ROWS), a call with many rows (a prompt chunk)
goes to MKL's sgemm on the plain matrix instead, which there beats oneDNN's packed kernel from about
128 rows, while the packed kernel wins by up to 2x at decode batches: the plain matrix stays beside
its packed copy.

Only plain nn.Linear projections of a CPU model in float32 or bfloat16 are packed; quantized ones
(engine/load/quant.py) and MoE experts keep their own kernels. A tied LM head gets a packed copy of
the embedding matrix (the embedding itself stays a lookup table).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.load.dtype import cpu_kind

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

log = logging.getLogger("conveyor.prepack")
PACKABLE = (torch.float32, torch.bfloat16)
# Rows from which a float32 GEMM takes MKL's sgemm on the plain matrix, by torch's CPU capability.
# Measured on an AVX2 EPYC (2 cores, SmolLM2-135M's shapes): MKL 170-185 GFLOP/s from 128 rows
# against oneDNN's packed 150-165, and oneDNN's packed kernel 1.1-2x faster at 8-64 rows
# (docs/performance.md, "Prompt chunks on MKL"). Absent: packed at every row count (the CPU kind is
# unmeasured).
PLAIN_FROM_ROWS: dict[str, int] = {"AVX2": 128}
# Rows from which a weight-only quantized projection (engine/load/quant.py) multiplies with a packed
# bfloat16 copy of its dequantized matrix instead of torch's int kernel, by CPU kind
# (engine/load/dtype.py's cpu_kind), thread count and kernel. The int kernels read 4 or 8 bits a
# weight, so they win while a GEMM is bound by memory (a few rows), but compute at 280-350 GFLOP/s
# at every row count (int4 re-dequantizes the weight for every 4 rows), where oneDNN's packed
# bfloat16 reaches 650 at 32 rows. Measured with `python bench/quantized.py --gemm` over
# SmolLM2-135M's 30 layers called in turn, as a forward calls them (docs/performance.md, "Quantized
# weights by row count"); each entry is the first row count measured from which the packed copy was
# faster (as a calibration picks it). A (kind, threads) absent here is measured at load instead
# (engine/kernel_choice.py). AVX512_BF16 (2-core EPYC): 1 thread from this bench (--cpu-time on a
# shared machine: int4 7.8 / 12.5 / 20.0 / 23.3 / 33.5 / 85.9 ms at 1 / 4 / 6 / 8 / 12 / 32 rows
# against 21.3 / 19.7 / 19.5 / 23.8 / 27.3 / 47.8 packed; the int8 head 4.6 ms at 1 row against 4.2
# packed); 2 threads from the quiet chain in ../shared/perf (int4 3.46 / 7.53 / 8.23 / 15.45 ms at 1
# / 4 / 8 / 16 rows against 8.11 / 7.99 / 9.64 / 11.27 packed; the int8 head 0.86 ms in a one-row
# step against 1.36, 1,984 us at 8 rows against 1,168). AMX (2-core Xeon): both thread counts from
# this bench on a quiet machine (docs/performance.md, "The AMX Xeon").
QUANTIZED_PACKED_FROM_ROWS: dict[str, dict[int, dict[str, int]]] = {
    "AVX512_BF16": {1: {"int4": 12, "int8": 1}, 2: {"int4": 16, "int8": 8}},
    "AMX": {1: {"int4": 8, "int8": 2}, 2: {"int4": 12, "int8": 6}},
}
# On AMX CPUs, where the int4 matrices also carry codes for the AMX kernel
# (kernels/cpu/quant_gemm.cpp), by thread count: (rows from which int4 calls take the AMX kernel
# instead of torch's, rows from which the packed copy takes over from it). The AMX kernel
# dequantizes each weight once per call, so it beats torch's int4 kernel from 3 rows; against the
# packed copies it wins or ties up to ~1,000 rows at 2 threads (a tie keeps the tiles: their rows'
# bits do not depend on the call's rows) and ~128 at 1; oneDNN's packed kernel wins the longest
# prompt chunks (2,048 rows: 1.4-1.9x). Measured with `python bench/quantized.py --gemm --threads N`
# on the quiet 2-core AMX Xeon (docs/performance.md, "The AMX Xeon"; 2026-11-27 in docs/kernels.md).
QUANTIZED_TILES_ROWS: dict[int, tuple[int, int]] = {1: (3, 128), 2: (3, 1024)}
# The plain copies cost the projections' size again: kept only while that is at most this much (a
# small model, whose prompt chunks are where its GEMM time goes), so a larger model's memory does
# not double.
PLAIN_MAX_BYTES = 1 << 30


def quantized_packed_from(kind: str, threads: int) -> dict[str, int] | None:
    """int4 / int8 -> the rows from which that kernel hands over to the packed copy on this CPU kind
    at this many threads; None where that was never measured."""
    return QUANTIZED_PACKED_FROM_ROWS.get(kind, {}).get(threads)


def plain_from_rows(dtype: torch.dtype) -> int | None:
    """The row count from which this CPU's float32 GEMMs go to the plain matrix; None: never."""
    if dtype != torch.float32:
        return None
    return PLAIN_FROM_ROWS.get(torch.backends.cpu.get_cpu_capability())


# On AMX CPUs oneDNN's packed bfloat16 calls of up to this many rows give each row the same
# bits; larger calls round a few rows otherwise (tests/kernels/test_quant_gemm.py). A fact of the
# pinned torch 2.13.0's oneDNN: torch 2.11's already differs at 32 rows (docs/kernels.md).
ONEDNN_SAME_BITS_ROWS = 32


def same_bits_rows(deterministic: bool, kind: str | None = None) -> int | None:
    """PackedLinear's max_rows: where --deterministic must cut calls for a row's bits to hold.
    kind: the CPU kind (tests), else this CPU's."""
    return ONEDNN_SAME_BITS_ROWS if deterministic and (kind or cpu_kind()) == "AMX" else None


class PackedLinear(nn.Module):
    """y = x @ W.T (+ b) with W in oneDNN's blocked layout (an opaque mkldnn tensor);
    from plain_from rows on, with the plain W through F.linear (MKL) instead, where
    that measured faster."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 plain_from: int | None = None, pad_one_row: bool = False,
                 max_rows: int | None = None) -> None:
        """pad_one_row (--deterministic): a one-row call runs as two rows, because oneDNN takes
        another kernel for one row of some shapes (K = 1536 here), which rounds that row
        differently than the same row of any larger call. max_rows (--deterministic on AMX CPUs,
        same_bits_rows()): larger calls are cut into calls of max_rows, because there oneDNN
        rounds a few rows of a call over ONEDNN_SAME_BITS_ROWS otherwise. With both, a row's
        result does not depend on the row count."""
        super().__init__()
        self.pad_one_row = pad_one_row
        self.max_rows = max_rows
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor
        # a buffer, so the model's size counts it
        self.register_buffer("packed",
                             torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)
        self.plain: torch.Tensor | None
        self.register_buffer("plain", weight.detach() if plain_from is not None else None,
                             persistent=False)
        self.plain_from = plain_from
        self.bias = bias

    def _plain_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The plain matrix when x has rows enough for MKL to be the faster kernel, else None."""
        return self.plain if self.plain_from is not None and x.shape[0] >= self.plain_from else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            step = self.max_rows
            return torch.cat([self.forward(x[i:i + step]) for i in range(0, x.shape[0], step)])
        if self.pad_one_row and x.shape[0] == 1:
            return self.forward(x.expand(2, -1).contiguous())[:1]
        if (plain := self._plain_for(x)) is not None:
            return F.linear(x, plain, self.bias)
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [],
                                                             "")
        return y

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h + x @ W.T (+ b), the addition fused into the GEMM."""
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            step = self.max_rows
            return torch.cat([self.add_to(h[i:i + step], x[i:i + step])
                              for i in range(0, x.shape[0], step)])
        if self.pad_one_row and x.shape[0] == 1:
            return self.add_to(h.expand(2, -1).contiguous(), x.expand(2, -1).contiguous())[:1]
        if (plain := self._plain_for(x)) is not None:
            out = torch.addmm(h, x, plain.t())
            return out if self.bias is None else out.add_(self.bias)
        if self.bias is not None:
            return h + self.forward(x)
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, h, self.packed, None, "add")
        return y


def usable(model: nn.Module, device: torch.device) -> bool:
    """Whether this torch, device and dtype can take packed weights. oneDNN packs bfloat16 only on
    CPUs with bfloat16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere (AVX2 alone) the
    reorder raises, and bfloat16 stays on F.linear."""
    dtype = next(model.parameters()).dtype
    if device.type != "cpu" or dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_model(model: LlamaForCausalLM, projections: tuple[str, ...],
                  deterministic: bool = False) -> int:
    """Replaces each decoder layer's plain projections and the LM head in place. -> matrices
    packed. deterministic: one kernel at every row count (no MKL from plain_from rows),
    one-row calls padded, large calls cut on AMX CPUs."""
    packed = 0
    plain_from = None if deterministic else plain_from_rows(next(model.parameters()).dtype)
    cut = same_bits_rows(deterministic)
    linears = [(layer, name) for layer in model.model.layers for name in projections
               if isinstance(getattr(layer, name, None), nn.Linear)]
    if sum(getattr(layer, name).weight.nbytes for layer, name in linears) > PLAIN_MAX_BYTES:
        plain_from = None
    for layer, name in linears:
        proj = getattr(layer, name)
        setattr(layer, name, PackedLinear(proj.weight, proj.bias, plain_from, deterministic, cut))
        packed += 1
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    if isinstance(head, (nn.Linear, nn.Embedding)):
        packed_head = PackedLinear(head.weight, None, plain_from, deterministic, cut)
        model.lm_head = packed_head  # type: ignore[assignment]
        packed += 1
    log.info("%d weight matrices prepacked for oneDNN%s", packed,
             f"; plain copies kept for calls of {plain_from}+ rows (MKL)" if plain_from is not None
             else "")
    return packed
