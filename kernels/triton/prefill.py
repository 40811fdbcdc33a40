"""Prefill and chunked prefill over the paged KV cache, varlen, with a cached prefix.

Sequence b brings q_len new tokens at positions ctx .. ctx+q_len-1; its keys are the whole paged
sequence 0 .. ctx+q_len-1, read from the cache (the new tokens' K/V were stored just before), so a
prefix-cache hit, a later chunk of a long prompt and a fresh prompt are one code path: new token
j sees every key at position <= ctx + j (full over the prefix, causal within the new tokens).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NotRequired

import torch
import triton
import triton.language as tl

from kernels.triton.decode import LOG2E, DecodeConfig, kv_tile, softmax_update


@triton.jit
def _attend_keys(  # type: ignore[no-untyped-def]  # Triton types the arguments at launch
    q, m, row_sum, acc,  # [BLOCK_M, BLOCK_D], [BLOCK_M], [BLOCK_M], [BLOCK_M, BLOCK_D] fp32
    q_pos,  # [BLOCK_M] position of each row's token
    k_cache_ptr, v_cache_ptr, bt_row, kvh,
    n_start, n_end, kv_end,
    qk_scale, stride_cb, stride_cs, stride_ch,
    d, d_mask,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online-softmax update of one query tile over keys [n_start, n_end). Unmasked: every row
    sees every key (the part of the prefix before the tile's first token), so no mask math."""
    for n0 in range(n_start, n_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = pos < kv_end
            block = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            block = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_mask[None, :]  # every key is in range: only the head-dim padding
        k, v = kv_tile(k_cache_ptr, v_cache_ptr, block, pos, kvh, d, kv_mask,
                       stride_cb, stride_cs, stride_ch, BLOCK_SIZE, UPCAST)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        m, row_sum, acc = softmax_update(scores, v, m, row_sum, acc, PRECISION)
    return m, row_sum, acc


@triton.jit
def _prefill_kernel(  # type: ignore[no-untyped-def]  # Triton types the arguments at launch
    q_ptr, out_ptr,  # [T, H, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    # [W] int32: the work list (sequence, first new token of the tile)
    tile_seq_ptr, tile_start_ptr,
    q_start_ptr, q_lens_ptr, ctx_lens_ptr,  # [B] int32: first row in q, new tokens, cached tokens
    block_tables_ptr,  # [B, max_blocks] int32
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    # Grid (W, Hkv): program (w, g) takes BLOCK_Q new tokens of one sequence times the GROUP query
    # heads of KV head g as one BLOCK_M = BLOCK_Q*GROUP_PAD row tile (GQA heads share every K/V
    # load), and sweeps keys 0 .. ctx + last token of the tile. The work list holds only real
    # tiles, so a batch of one long and many short prompts launches no idle programs.
    # Traffic: Q and O once (2*T*H*D); K/V: each tile reads its sequence's keys up to its last
    # token, i.e. about (ctx + q_len/2) * 2*D per tile per KV head.
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + w)
    tile_start = tl.load(tile_start_ptr + w)
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    ctx = tl.load(ctx_lens_ptr + seq)

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = tile_start + r // GROUP_PAD  # [BLOCK_M] index among the sequence's new tokens
    gh = r % GROUP_PAD
    heads = kvh * GROUP + gh
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    row_mask = (tok < q_len) & (gh < GROUP)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + tok

    m = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    kv_end = tl.minimum(ctx + tile_start + BLOCK_Q, ctx + q_len)  # one past the tile's last key
    # keys below: seen by every row of the tile
    full_end = ((ctx + tile_start) // BLOCK_N) * BLOCK_N
    m, row_sum, acc = _attend_keys(q, m, row_sum, acc, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kvh,
                                   0, full_end, kv_end, qk_scale, stride_cb, stride_cs, stride_ch,
                                   d, d_mask, False, BLOCK_N, BLOCK_SIZE, UPCAST, PRECISION)
    m, row_sum, acc = _attend_keys(q, m, row_sum, acc, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kvh,
                                   full_end, kv_end, kv_end, qk_scale, stride_cb, stride_cs,
                                   stride_ch, d, d_mask, True, BLOCK_N, BLOCK_SIZE, UPCAST,
                                   PRECISION)
    out = acc / row_sum[:, None]  # every row sees key 0, so row_sum > 0
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@dataclass(frozen=True)
class PrefillKnobs:
    """The launch choices of _prefill_kernel that only timing on a GPU can settle. None: the
    interpreter-safe rule (prefill_block_q, prefill_config), which is also every default today."""
    block_m: int | None = None  # tile rows, BLOCK_Q * padded GQA group; >= 16 for tl.dot
    block_n: int | None = None  # keys per inner iteration
    num_warps: int = 8
    num_stages: int | None = None  # None: Triton's own default


# Measured choices per GPU kind: CUDA capability ("sm90"), then (dtype bits, padded head dim). The
# one place bench/triton_tune.py's results go. Not listed (and the CPU interpreter): PrefillKnobs(),
# the fallback. sm90: `python bench/triton_tune.py` on an H100, bfloat16, 2026-11-26, the best
# config over the quick and full sweeps: 1.8-1.9x the fallback at head dim 64 (SmolLM2 9/3 and 32/8
# heads), 2.0-2.2x at 128 (docs/kernels.md, "Prefill tiles tuned on the H100"). H200s are sm90 too.
PREFILL_TUNED: dict[str, dict[tuple[int, int], PrefillKnobs]] = {
    "sm90": {
        (16, 64): PrefillKnobs(block_m=64, block_n=64, num_warps=4, num_stages=2),
        (16, 128): PrefillKnobs(block_m=128, block_n=32, num_warps=8, num_stages=2),
    },
}


@functools.lru_cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def device_arch(device: torch.device) -> str | None:
    """PREFILL_TUNED's key for a device: "sm90" on an H100, None off CUDA (the
    interpreter's CPU tensors)."""
    if device.type != "cuda":
        return None
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def prefill_knobs(arch: str | None, head_dim: int, dtype: torch.dtype, group: int) -> PrefillKnobs:
    """The table's entry for this GPU kind and shape, or the fallback: what launches by
    default. The table was measured on GQA shapes (groups 3 and 4); without GQA (group 1) its
    tiles spill registers on sm_90 (test_triton_compile.py), so those shapes keep the fallback
    until a sweep covers them."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if group < 2:
        return PrefillKnobs()
    return PREFILL_TUNED.get(arch or "", {}).get((8 * dtype.itemsize, block_d), PrefillKnobs())


def prefill_block_q(num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                    block_m: int | None = None) -> int:
    """New tokens per tile. The tile has BLOCK_M = BLOCK_Q * padded GQA group rows, >= 16
    for tl.dot: by default 64 for 16-bit types, 32 for fp32 (whose non-tensor-core dot
    needs more registers)."""
    block_m = block_m or (64 if dtype.itemsize <= 2 else 32)
    group_pad: int = triton.next_power_of_2(num_heads // num_kv_heads)
    min_q: int = triton.cdiv(16, group_pad)  # tiles of at least 16 rows
    return max(1, block_m // group_pad, min_q)


class PrefillConfig(DecodeConfig):
    """_prefill_kernel's constexprs and launch options, passed as **config: the decode kernel's,
    plus the new tokens per tile and the pipeline stages where tuned."""
    BLOCK_Q: int
    num_stages: NotRequired[int]


def prefill_config(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype, interpret: bool,
                   knobs: PrefillKnobs | None = None) -> PrefillConfig:
    """Constexprs and launch options of _prefill_kernel; shared with the compile test. Fallback:
    64-row tiles, 8 KiB K/V tiles and 8 warps, which compile without register spills on sm_90 for
    head dims 64 and 128 (ptxas -v, checked by test_triton_compile.py); PREFILL_TUNED holds the
    timed choices."""
    knobs = knobs or PrefillKnobs()
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile_elems = 8192 // dtype.itemsize
    config = PrefillConfig(
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=prefill_block_q(num_heads, num_kv_heads, dtype, knobs.block_m),
        D=head_dim, BLOCK_D=block_d, BLOCK_N=knobs.block_n
        or min(128, max(16, tile_elems // block_d)),
        BLOCK_SIZE=block_size, UPCAST=interpret,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=knobs.num_warps,
    )
    if knobs.num_stages is not None:
        config["num_stages"] = knobs.num_stages
    return config


def prefill_tiles(q_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """The work list: (sequence index, first new token) of every BLOCK_Q-token tile."""
    seqs, starts = [], []
    for i, n in enumerate(q_lens):
        for s in range(0, n, block_q):
            seqs.append(i)
            starts.append(s)
    return seqs, starts


def prefill_attention(
    out: torch.Tensor,  # [T, H, D]
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    tile_seq: torch.Tensor,  # [W] int32
    # [W] int32, built by prefill_tiles with prefill_block_q(H, Hkv, dtype, knobs.block_m)
    tile_start: torch.Tensor,
    q_start: torch.Tensor,  # [B] int32
    q_lens: torch.Tensor,  # [B] int32
    ctx_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    # None: the table's entry for this device (bench/triton_tune.py passes its own)
    knobs: PrefillKnobs | None = None,
) -> None:
    """Attend every new token of the listed sequences to its sequence's paged K/V."""
    _, h, d = q.shape
    num_blocks, block_size, hkv, cd = k_cache.shape
    b, w = q_lens.numel(), tile_seq.numel()
    assert out.shape == q.shape and cd == d and h % hkv == 0 and v_cache.shape == k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert tile_start.shape == (w,) and q_start.shape == ctx_lens.shape == (b,)
    assert block_tables.shape[0] == b
    assert all(t.dtype == torch.int32
               for t in (tile_seq, tile_start, q_start, q_lens, ctx_lens, block_tables))
    assert block_tables.stride(1) == 1
    if w == 0:
        return
    knobs = knobs or prefill_knobs(device_arch(q.device), d, q.dtype, h // hkv)
    config = prefill_config(h, hkv, d, block_size, q.dtype, interpret=q.device.type != "cuda",
                            knobs=knobs)
    assert config["BLOCK_Q"] * config["GROUP_PAD"] >= 16, "tl.dot needs >= 16 rows"
    _prefill_kernel[(w, hkv)](
        q, out, k_cache, v_cache, tile_seq, tile_start, q_start, q_lens, ctx_lens, block_tables,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        **config,
    )
