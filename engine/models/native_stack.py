"""Every decoder layer in one native call (conveyor_cpu::decoder_layers,
kernels/cpu/decoder_layers.cpp) for the CPU default's common case: plain Llama layers
(DecoderLayer.native_parts) whose projections are int4 on the AMX kernel at every row count,
bfloat16, every row of the step on the native attention kernel. The call runs the ops
DecoderLayer.forward calls, in its order, without the Python between them (about 100 us a layer, a
quarter of a one-row step); any other model or step runs each layer's forward."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from engine.load import amx
from engine.load.quant import Int4Linear
from kernels.torch_backend import NativeStep


class LayerParts(NamedTuple):
    weights: list[torch.Tensor]  # norm, qkv codes, scales, o's, norm, gate_up's, down's
    min_exponents: list[int]  # qkv, o, gate_up, down (amx.min_exponent)
    settings: tuple[int, int, float, float]  # heads, KV heads, the norms' eps, attention scale


class NativeStack(NamedTuple):
    """Every layer's weights in the order decoder_layers takes them, and their shared settings."""

    weights: list[torch.Tensor]
    min_exponents: list[int]
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float


def _tiles(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """An int4 projection's AMX codes, scales and min_exponent where its forward takes the AMX
    kernel at every row count and has no bias (the quantized default on AMX CPUs:
    engine/kernel_choice.py), so the native call takes the kernel its forward takes; else None."""
    if not isinstance(m, Int4Linear) or type(m) is not Int4Linear:  # not a wrapper's subclass
        return None
    codes, scale_zero = m.tile_codes, m.tile_scale_zero
    if codes is None or scale_zero is None or m.packed is not None or m.amx_from > 1:
        return None
    return None if m.bias is not None else (codes, scale_zero, m.tile_min_exponent)


def layer_parts(norm: nn.RMSNorm, post_norm: nn.RMSNorm, projections: Sequence[nn.Module],
                num_heads: int, num_kv_heads: int, scale: float) -> LayerParts | None:
    """One plain layer's part of the stack: its norms (bfloat16, one eps) and its qkv, o, gate_up
    and down projections with _tiles; else None."""
    tiles = [_tiles(m) for m in projections]
    eps = norm.eps
    if eps is None or post_norm.eps != eps or any(
            n.weight.dtype != torch.bfloat16 for n in (norm, post_norm)):
        return None
    present = [t for t in tiles if t is not None]
    if len(present) != 4 or len(tiles) != 4:
        return None
    qkv, o, gate_up, down = present
    weights = [norm.weight, *qkv[:2], *o[:2], post_norm.weight, *gate_up[:2], *down[:2]]
    return LayerParts(weights, [qkv[2], o[2], gate_up[2], down[2]],
                      (num_heads, num_kv_heads, eps, scale))


def stack_of(parts: Iterable[LayerParts | None]) -> NativeStack | None:
    """The stack where every layer has its parts, with the same settings; else None."""
    weights: list[torch.Tensor] = []
    exps: list[int] = []
    settings = set()
    for p in parts:
        if p is None:
            return None
        weights += p.weights
        exps += p.min_exponents
        settings.add(p.settings)
    if len(settings) != 1:
        return None
    heads, kv_heads, eps, scale = settings.pop()
    return NativeStack(weights, exps, heads, kv_heads, eps, scale)


def run_stack(stack: NativeStack, h: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor,
              positions: torch.Tensor, step: NativeStep) -> torch.Tensor:
    """h [T, E] through every layer -> [T, E]; kv_cache [layers, 2, blocks, block_size, Hkv, D];
    the RoPE table and positions as rope_ takes them; step: TorchBackend.native_step."""
    out: torch.Tensor = torch.ops.conveyor_cpu.decoder_layers(
        h, stack.weights, stack.min_exponents, kv_cache, table, positions, stack.num_heads,
        stack.num_kv_heads, stack.eps, stack.scale, amx.ROWS_PATH_MAX, *step)
    return out
