"""Rotary position embeddings: frequency tables computed exactly as transformers does
(same float ops), kept as a [positions, D/2, 2] (cos, sin) table that the model indexes
by position once per step.

q and k rows are kept in the *interleaved* layout (dims 2i and 2i+1 rotate together, as in Meta's
original checkpoints and in GGUF), so RoPE is one complex multiply instead of HF's rotate_half.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from engine.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, long: bool = False) -> torch.Tensor:
    """-> [D/2] float32 rotation frequencies. theta overrides the config's base (Gemma 3's sliding
    layers); long picks LongRoPE's long factors."""
    d = cfg.head_dim
    base = cfg.rope_theta if theta is None else theta
    exponent = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    s = cfg.rope_scaling if theta is None else None
    if s is not None and s["rope_type"] == "longrope":
        factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32,
                               device="cpu")
        return 1.0 / (factors * base**exponent)
    inv = 1.0 / (base**exponent)
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    # llama3: keep high frequencies, divide low ones by factor, interpolate smoothly in between.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_table(cfg: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """-> [max_position_embeddings, D/2, 2] float32 (cos, sin), on the CPU even under a meta-device
    context, so a model built on meta has a real table.

    LongRoPE (Phi-3): positions below original_max_position_embeddings rotate by the short factors
    and later ones by the long factors, all scaled by the attention factor. transformers switches
    the whole forward to the long factors once the sequence passes that length (earlier cached keys
    keep the short ones); the two agree on every sequence shorter than it."""
    pos = torch.arange(cfg.max_position_embeddings, device="cpu").float()
    angles = torch.outer(pos, rope_inv_freq(cfg, theta))  # [P, D/2]
    s = cfg.rope_scaling if theta is None else None
    if s is None or s["rope_type"] != "longrope":
        return torch.stack((angles.cos(), angles.sin()), dim=-1)
    orig = int(s["original_max_position_embeddings"])
    long = torch.outer(pos, rope_inv_freq(cfg, long=True))
    angles = torch.where((pos >= orig)[:, None], long, angles)
    factor = s.get("factor") or cfg.max_position_embeddings / orig
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return torch.stack((angles.cos() * attn, angles.sin() * attn), dim=-1)


class Rotation(NamedTuple):
    """One step's rotation, shared by every layer with the same table: the native op reads the table
    at the positions; the PyTorch path multiplies by the step's complex factors, gathered once."""
    table: torch.Tensor  # [P, D/2, 2] float32 (cos, sin)
    positions: torch.Tensor  # [T] int64
    # [T, 1, D/2] complex64; None: the native op (kernels/cpu/layer_ops.cpp)
    factors: torch.Tensor | None


def rotation(table: torch.Tensor, positions: torch.Tensor, native: bool) -> Rotation:
    factors = None if native else torch.view_as_complex(table[positions]).unsqueeze(1)
    return Rotation(table, positions, factors)


def apply_rope(x: torch.Tensor, rot: Rotation) -> torch.Tensor:
    """x: [T, N, D] with interleaved pairs -> [T, N, D] in x.dtype: x itself, turned in place, on
    the native path (x is a fresh GEMM output there); a new tensor on the PyTorch path."""
    if rot.factors is None:
        torch.ops.conveyor_cpu.rope_(x, rot.table, rot.positions)
        return x
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [T, N, D/2]
    return torch.view_as_real(xc * rot.factors).flatten(-2).type_as(x)


def to_interleaved(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q/k rows (or a per-head norm's weights) from HF's half-split RoPE layout (dim j pairs with j
    + D/2) to interleaved pairs (2j, 2j+1). This is the permutation llama.cpp's converter applies;
    engine/load/gguf.py undoes it for GGUF files."""
    d_half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, d_half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
