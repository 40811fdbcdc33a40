"""Weight-only quantized projections: int8 and int4 weights multiplied by PyTorch's own CPU kernels,
so a quantized GGUF is served at its own size instead of inflated to float32.

- int8: one scale per output row (torch.ops.aten._weight_int8pack_mm). GGUF's Q8_0 has a scale per
  32 weights; the kernel takes one per row, so Q8_0 matrices are re-quantized per row (round to
  nearest of w / (max|w_row| / 127)).
- int4: a scale and a zero per 32 weights of a row (_weight_int4pack_mm_for_cpu computes
  (q - 8) * scale + zero). GGUF's Q4_0 (d * (q - 8)) and Q4_1 (d * q + m) blocks are exactly that
  form, so their codes are carried over bit for bit (groups from engine/load/gguf.py); other formats
  (Q4_K, Q5_*, ...) and float checkpoints are quantized here per group of 32 from their min and max.
- Embeddings are looked up, not multiplied: they are kept as int8 rows (a tied LM head uses the same
  int8 matrix) and dequantized per call, only the rows a step reads.
- The int kernels win only while a GEMM is bound by memory (a few rows): a projection may also hold
  a oneDNN-packed copy of its dequantized matrix, which calls of packed_from rows or more take
  (engine/kernel_choice.py). Our own kernels (AMX, AVX-512 BF16, AVX2 with float32 activations,
  w4a8) replace torch's where the CPU runs them.
- Matrices the int4 kernel cannot take (in-features not a multiple of 32) fall back to int8; MoE
  experts stay in the model's dtype.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.load import amx, int4_avx2, int4_avx512, int8_avx2
from engine.load.prepack import PackedLinear

log = logging.getLogger("conveyor.quant")

GROUP = 32
NEVER = 1 << 62  # a row threshold no call reaches
# Rows quantized at a time, so the float temporaries stay this many rows, not the matrix (a multiple
# of 64: the int4 packing works on blocks of rows).
CHUNK_ROWS = 1024
# Our parameter names (engine/models/llama.py) of the projections each decoder layer quantizes.
LAYER_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# param name -> (scale, min) [N, K/32]: w = scale * q + min
Groups = dict[str, tuple[torch.Tensor, torch.Tensor]]


class QuantizedLinear(nn.Module):
    """What the int8 and int4 projections share: the choice, by rows, between torch's int kernel and
    a packed copy of the dequantized matrix (packed; None: the int kernel at every row count)."""

    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.packed: PackedLinear | None = None
        self.packed_from = 0
        # rows from which a matrix with AMX (int8: or AVX2) codes takes that kernel
        self.amx_from = NEVER

    def amx_mm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """x @ W.T (+ residual) on AMX tiles where this matrix runs them at x's rows; else None."""
        return None

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T through torch's int kernel, without the bias."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """W [N, K] in the activations' dtype, as the int kernel sees it."""
        raise NotImplementedError

    def shape(self) -> tuple[int, int]:
        """(out features N, in features K)."""
        raise NotImplementedError

    def scales_dtype(self) -> torch.dtype:
        """The activations' dtype the kernel computes in."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mm(x)
        return y if self.bias is None else y + self.bias

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h + x @ W.T (+ b); on the packed copy and the AMX kernel the addition is fused into the
        GEMM."""
        if self.bias is not None:
            return h + self.forward(x)
        return self.mm(x, h)

    def mm(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ h) on the kernel for x's rows, without the bias. The row tests come first:
        packed and the codes are submodules and buffers, which nn.Module looks up slowly."""
        rows = x.shape[0]
        if rows >= self.packed_from and self.packed is not None:
            return self.packed.forward(x) if h is None else self.packed.add_to(h, x)
        if rows >= self.amx_from:
            tiles = self.amx_mm(x, h)
            if tiles is not None:
                return tiles
        y = self.quantized_mm(x)
        return y if h is None else h + y


class Int8Linear(QuantizedLinear):
    """y = x @ (q * scale[:, None]).T (+ bias); q int8 [N, K], one scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 absmax: torch.Tensor | None = None) -> None:
        """absmax: [N] each row's largest |w| where weight holds only some of the row's
        columns (a tensor-parallel rank's row-parallel shard), so its codes and scales
        are the whole matrix's."""
        super().__init__()
        w = weight.detach()  # no autograd graph: it would keep the float matrix alive
        n = w.shape[0]
        scale = torch.empty(n)
        q = torch.empty(w.shape, dtype=torch.int8)
        for r in range(0, n, CHUNK_ROWS):
            rows = w[r:r + CHUNK_ROWS].float()
            # [rows]
            peak = rows.abs().amax(dim=1) if absmax is None else absmax[r:r + CHUNK_ROWS].float()
            s = (peak / 127).clamp(min=1e-12)  # [rows]
            scale[r:r + CHUNK_ROWS] = s
            q[r:r + CHUNK_ROWS] = torch.round(rows / s[:, None]).clamp_(-127, 127)
        self.qweight: torch.Tensor | None  # None once only the AVX2 kernel's layout is kept
        self.scales: torch.Tensor
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype),
                                                           requires_grad=False)
        # codes for the int8 AMX kernel, made after load where they multiply
        self.tile_codes: torch.Tensor | None = None
        self.tile_scale: torch.Tensor | None = None
        self.tiles_avx512 = False  # on the kernel's rows path only (no AMX)
        self.avx2_codes: torch.Tensor | None  # make_avx2's
        self.register_buffer("avx2_codes", None, persistent=False)

    def codes(self) -> torch.Tensor:
        """q int8 [N, K]."""
        return self.qweight if self.qweight is not None else int8_avx2.unpack(self._avx2())

    def _avx2(self) -> torch.Tensor:
        assert self.avx2_codes is not None
        return self.avx2_codes

    def keep_avx2_codes_only(self) -> None:
        """Drops the [N, K] codes once the AVX2 kernel takes every call (amx_from 1, as
        kernel_choice.attach_int8_avx2 sets it): the tied head's codes took twice their size."""
        assert self.avx2_codes is not None and self.amx_from == 1
        self.qweight = None

    def make_tiles(self, avx512: bool = False) -> bool:
        """Repacks the codes for the int8 AMX kernel (engine/load/amx.py) where this CPU runs it
        (avx512: its rows path alone, on AVX-512 BF16) and x is bfloat16. -> whether it has them."""
        n, k = self.shape()
        runs = int4_avx512.usable() if avx512 else amx.usable()
        if self.tile_codes is None and self.scales.dtype == torch.bfloat16 and amx.fits(n, k) \
                and runs:
            self.tile_codes = amx.pack_int8(self.codes())
            self.tile_scale = self.scales.float()
            self.tiles_avx512 = avx512
        return self.tile_codes is not None

    def make_avx2(self) -> bool:
        """Repacks the codes for engine/load/int8_avx2.py where this CPU runs it and the
        activations are float32. -> whether the matrix has them."""
        if self.avx2_codes is None and self.scales.dtype == torch.float32 \
                and int8_avx2.fits(self.shape()[0]) and int8_avx2.usable():
            self.avx2_codes = int8_avx2.pack(self.codes())
        return self.avx2_codes is not None

    def amx_mm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """On the AMX kernel (make_tiles) or the AVX2 one (make_avx2) from amx_from rows."""
        if x.shape[0] < self.amx_from:
            return None
        codes, scale = self.tile_codes, self.tile_scale
        if codes is not None and scale is not None:  # x is bfloat16, as the scales (make_tiles)
            y = (amx.int8_mm_rows if self.tiles_avx512 else amx.int8_mm)(x, codes, scale)
        elif self.avx2_codes is not None:
            y = int8_avx2.int8_mm(x, self.avx2_codes, self.scales)  # float32 x
        else:
            return None
        return y if residual is None else residual + y

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:  # only the AVX2 layout: a 0-row call
            return int8_avx2.int8_mm(x, self._avx2(), self.scales)
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight,
                                                             self.scales)
        return y

    def shape(self) -> tuple[int, int]:
        if self.qweight is None:
            blocks, k, block = self._avx2().shape
            return blocks * block, k
        n, k = self.qweight.shape
        return n, k

    def scales_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: -> [len(ids), K] dequantized rows."""
        q = self.qweight[ids] if self.qweight is not None else int8_avx2.rows(self._avx2(), ids)
        return q.to(self.scales.dtype) * self.scales[ids, None]

    def dequantized(self) -> torch.Tensor:
        return self.codes().to(self.scales.dtype) * self.scales[:, None]


class Int4Linear(QuantizedLinear):
    """y = x @ W.T (+ bias) with W[n, k] = (q - 8) * scale[g, n] + zero[g, n] for g = k // 32, q in
    0..15."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 groups: tuple[torch.Tensor, torch.Tensor] | None = None,
                 round_x: bool = False) -> None:
        """round_x: where the AVX2 kernel takes the matrix, it multiplies activations rounded to
        8 bits per group of 32 (--quantization w4a8; int4_avx2.int4_mm)."""
        super().__init__()
        # no autograd graph: it would keep the float matrix alive beside its codes
        w = weight.detach()
        n, k = w.shape
        scales, lows, packed, tiles = [], [], [], []
        with_tiles = (dtype == torch.bfloat16 and amx.fits(n, k)
                      and (amx.usable() or int4_avx512.usable()))
        with_avx2 = dtype == torch.float32 and int4_avx2.fits(n, k) and int4_avx2.usable()
        for r in range(0, n, CHUNK_ROWS):
            wg = w[r:r + CHUNK_ROWS].float().view(-1, k // GROUP, GROUP)
            if groups is None:  # from the values: the group's min to its max in 15 steps
                lo, hi = wg.amin(dim=2), wg.amax(dim=2)  # [rows, K/32]
                scale, low = ((hi - lo) / 15).clamp(min=1e-12), lo
            else:
                scale = groups[0][r:r + CHUNK_ROWS].float()
                low = groups[1][r:r + CHUNK_ROWS].float()
            q = torch.round((wg - low[..., None]) / scale[..., None]).clamp_(0, 15)
            q = q.to(torch.int32).view(-1, k)
            packed.append(int4_avx2.pack_codes(q) if with_avx2
                          else torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            if with_tiles:
                tiles.append(amx.pack_int4(q, scale, low + 8 * scale))
            scales.append(scale)
            lows.append(low)
        scale, low = torch.cat(scales), torch.cat(lows)  # [N, K/32]
        zero = low + 8 * scale  # (q - 8) * scale + zero == q * scale + low
        self.qweight: torch.Tensor
        self.scales_zeros: torch.Tensor
        self.register_buffer("qweight", packed[0] if len(packed) == 1 else torch.cat(packed))
        self.register_buffer("scales_zeros",
                             torch.stack((scale.t(), zero.t()), dim=-1).to(dtype).contiguous())
        # The same codes repacked for the AMX kernel (engine/load/amx.py), where this CPU runs it or
        # the AVX-512 BF16 one that reads them (engine/load/int4_avx512.py; chosen by tiles_avx512).
        self.tile_codes: torch.Tensor | None
        self.tile_scale_zero: torch.Tensor | None
        self.register_buffer("tile_codes", torch.cat([c for c, _ in tiles]) if tiles else None)
        self.register_buffer("tile_scale_zero", torch.cat([z for _, z in tiles]) if tiles else None)
        self.tile_min_exponent = (amx.min_exponent(self.tile_codes, self.tile_scale_zero)
                                  if self.tile_codes is not None
                                  and self.tile_scale_zero is not None else 0)
        self.tiles_avx512 = False  # the codes multiply on the AVX-512 BF16 kernel, not on AMX
        # set: qweight is in the AVX2 kernel's layout
        self.avx2_scale_low: torch.Tensor | None
        self.register_buffer("avx2_scale_low",
                             int4_avx2.pack_scales(scale, low) if with_avx2 else None)
        self.avx2_q8 = round_x and with_avx2
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype),
                                                           requires_grad=False)

    def amx_mm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.avx2_scale_low is not None:
            return int4_avx2.int4_mm(x, self.qweight, self.avx2_scale_low, residual, self.avx2_q8)
        if self.tile_codes is None or x.shape[0] < self.amx_from:
            return None
        return self.tile_mm(x, residual)

    def tile_mm(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ residual) on the AMX kernel (its rows path for a few rows), or on the AVX-512
        BF16 one where tiles_avx512, whatever the rows."""
        codes, scale_zero = self.tile_codes, self.tile_scale_zero
        assert codes is not None and scale_zero is not None
        if x.dtype != torch.bfloat16:  # a no-op .to() still costs a call's dispatch
            x = x.to(torch.bfloat16)
        if self.tiles_avx512:
            return int4_avx512.int4_mm(x, codes, scale_zero, residual)
        return amx.int4_mm(x, codes, scale_zero, self.tile_min_exponent, residual)

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.avx2_scale_low is not None:
            return int4_avx2.int4_mm(x, self.qweight, self.avx2_scale_low, None, self.avx2_q8)
        scales_zeros = self.scales_zeros
        if x.dtype != scales_zeros.dtype:
            x = x.to(scales_zeros.dtype)
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.qweight,
                                                                     GROUP, scales_zeros)
        return y

    def shape(self) -> tuple[int, int]:
        groups, n, _ = self.scales_zeros.shape
        return n, groups * GROUP

    def scales_dtype(self) -> torch.dtype:
        return self.scales_zeros.dtype

    def dequantized(self) -> torch.Tensor:
        """The kernel's own dequantization, read back through it: I @ W.T = W.T, exact in float32
        (one non-zero product per output), rounded once to the activations' dtype; AVX2
        codes: q * scale + low."""
        if self.avx2_scale_low is not None:
            return int4_avx2.unpack(self.qweight, self.avx2_scale_low)
        k = self.shape()[1]
        eye = torch.eye(k, dtype=self.scales_zeros.dtype)
        cols = [self.quantized_mm(eye[r:r + CHUNK_ROWS]) for r in range(0, k, CHUNK_ROWS)]
        return torch.cat(cols).t().contiguous()
