"""Every decoder layer in one native call (conveyor_cpu::decoder_layers,
kernels/cpu/decoder_layers.cpp) for the CPU default's common cases: plain Llama layers whose
projections are int4 on the AMX kernel at every row count or on the AVX-512 BF16 one below its
packed copy's rows (bfloat16), oneDNN's packed matrices or int4 on an AVX2 kernel (float32), every
row of the step on the native attention kernel. The call runs the ops DecoderLayer.forward calls,
in its order, without the Python between them (about 100 us a layer, a quarter of a one-row
step); any other model or step runs each layer's forward. Loading decides whether a model has a
stack (engine/native_stack_choice.py native_stack_of), since it chose the GEMMs' kernels."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.torch_backend import NativeStep

# A projection's kind in decoder_layers (its Kind enum): which kernel its module's forward takes
# at each row count, so which tensors and ints describe it (engine/native_stack_choice.py writes
# them).
INT4_AMX = 0  # tensors: tile codes, scales; ints: min_exponent, amx.ROWS_PATH_MAX
PACKED = 1  # tensors: oneDNN's packed matrix, the plain one; ints: plain_from (-1: never)
# tensors: AVX2 codes, scale_low, then a PACKED copy's two; ints: x_bits (8: activations rounded
# to 8 bits, 32: float32), packed_from (-1: no copy), the copy's plain_from
INT4_AVX2 = 2
# tensors: tile codes, scales (the AVX-512 BF16 int4 kernel, no AMX), then a PACKED copy's two;
# ints: packed_from (-1: no copy, the kernel at every row count), the copy's plain_from
INT4_AVX512 = 3


class Projection(NamedTuple):
    """How one projection multiplies in the native call: its kind, then its tensors and ints."""

    kind: int
    tensors: list[torch.Tensor]
    ints: list[int]


class NativeStack(NamedTuple):
    """Every layer's weights in the order decoder_layers takes them (per layer: the input norm,
    qkv's tensors, o's, the post-attention norm, gate_up's, down's), the projections' kinds each
    followed by its ints (qkv, o, gate_up, down), and the settings the layers share."""

    weights: list[torch.Tensor]
    projections: list[int]
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float


def run_stack(stack: NativeStack, h: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor,
              positions: torch.Tensor, step: NativeStep) -> torch.Tensor:
    """h [T, E] through every layer -> [T, E]; kv_cache [layers, 2, blocks, block_size, Hkv, D];
    the RoPE table and positions as rope_ takes them; step: TorchBackend.native_step."""
    out: torch.Tensor = torch.ops.conveyor_cpu.decoder_layers(
        h, stack.weights, stack.projections, kv_cache, table, positions, stack.num_heads,
        stack.num_kv_heads, stack.eps, stack.scale, *step)
    return out
