"""Paged-attention decode: one query token per sequence, grouped-query attention, split-K.

A decode step is bound by reading the KV cache, so the kernel is laid out to read each cached
K/V row once per step: one program serves all the query heads that share a KV head (GQA), and
long sequences are split along the KV length into partitions that run in parallel
(flash-decoding), followed by a small reduce that merges the partitions' partial softmaxes.
"""
from __future__ import annotations

from typing import TypedDict

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def kv_tile(  # type: ignore[no-untyped-def]  # Triton types the arguments at launch
    k_cache_ptr, v_cache_ptr, block, pos, kvh, d, kv_mask,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr,
):
    """The K and V rows of key positions `pos` ([BLOCK_N]) from their cache blocks `block`."""
    kv_off = (block[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_cs
              + kvh * stride_ch + d[None, :])
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def softmax_update(  # type: ignore[no-untyped-def]  # Triton types the arguments at launch
    scores, v, m, row_sum, acc, PRECISION: tl.constexpr,
):
    """One online-softmax step (base 2): fold a tile of scores and its values into the running
    max, sum and output of every row. -> the new (m, row_sum, acc)."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, row_sum, acc


# Triton types the arguments at launch.
@triton.jit
def _decode_partition_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [T, H, D]; row q_rows[b] is sequence b's query
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, H, D], written directly when there is one partition
    part_out_ptr,  # [B, H, S, D] fp32 partial outputs (normalised per partition)
    part_lse_ptr,  # [B, H, S] fp32 log2-sum-exp2 of each partition's scores
    q_rows_ptr, seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    # keys per partition, a multiple of BLOCK_N (runtime: varies per step, no recompiles)
    partition,
    num_splits,
    # query heads per KV head, padded to >= 16 for tl.dot
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,  # do dots in fp32 (the interpreter's bf16 tl.dot is wrong)
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, so fp32 is not silently tf32
):
    # Grid (B, Hkv, S): program (b, kvh, s) attends the GROUP query heads of KV head kvh of sequence
    # b to keys [s*partition, min((s+1)*partition, seq_len)), BLOCK_N keys (possibly spanning
    # several cache blocks) per iteration. Traffic: each K/V row of the sequence is read exactly
    # once per KV head (2*L*D elements per (b, g)), plus the GROUP*D query once per program and,
    # when S > 1, GROUP*(D+1) fp32 partial results written per program and read back by the reduce.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = s * partition
    if start >= seq_len:  # this sequence is shorter than the longest: nothing to do
        return
    end = tl.minimum(start + partition, seq_len)
    row = tl.load(q_rows_ptr + b).to(tl.int64)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g  # [GROUP_PAD]
    g_mask = g < GROUP
    d_mask = d < D
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    # running max (finite: masked tiles stay NaN-free)
    m = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_mask = pos < end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k, v = kv_tile(k_cache_ptr, v_cache_ptr, block, pos, kvh, d, kv_mask,
                       stride_cb, stride_cs, stride_ch, BLOCK_SIZE, UPCAST)
        # [GROUP_PAD, BLOCK_N]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m, row_sum, acc = softmax_update(scores, v, m, row_sum, acc, PRECISION)

    o_mask = g_mask[:, None] & d_mask[None, :]
    out = acc / row_sum[:, None]  # row_sum > 0: the partition holds at least one key
    if num_splits == 1:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # [GROUP_PAD] in [B*H*S]
        part = (b * GROUP * tl.num_programs(1) + heads).to(tl.int64) * num_splits + s
        tl.store(part_out_ptr + part[:, None] * D + d[None, :], out, mask=o_mask)
        tl.store(part_lse_ptr + part, m + tl.log2(row_sum), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]  # Triton types the arguments at launch
    out_ptr,  # [T, H, D]
    part_out_ptr, part_lse_ptr,  # [B, H, S, D], [B, H, S] fp32
    q_rows_ptr, seq_lens_ptr,  # [B] int32
    stride_ot, stride_oh,
    H, partition, num_splits,
    SPLITS_PAD: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (B, H): merges the valid partitions of one (sequence, head): out = sum_s w_s * o_s with
    # w_s = 2^(lse_s - max lse) / sum. Traffic: reads S*(D+1) fp32, writes D elements; partitions
    # past the sequence's end were never written and are masked out, not read.
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    num_valid = tl.cdiv(seq_len, partition)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_valid
    base = (b * H + h).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_mask, other=float("-inf"))  # [SPLITS_PAD]
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    o = tl.load(part_out_ptr + (base + s)[:, None] * D + d[None, :],
                mask=s_mask[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(o * w[:, None], 0)  # [BLOCK_D]
    row = tl.load(q_rows_ptr + b).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < D)


def decode_block_n(head_dim: int) -> int:
    """Keys per iteration: a [BLOCK_N, BLOCK_D] tile of 4096 elements, which compiles without
    register spills at 8 warps on sm_90 for head dims 64 and 128 (checked with ptxas -v)."""
    block_d: int = max(16, triton.next_power_of_2(head_dim))
    return min(128, max(16, 4096 // block_d))


class DecodeConfig(TypedDict):
    """_decode_partition_kernel's constexprs and launch option, passed as **config."""
    GROUP: int
    GROUP_PAD: int
    D: int
    BLOCK_D: int
    BLOCK_N: int
    BLOCK_SIZE: int
    UPCAST: bool
    PRECISION: str
    num_warps: int


class ReduceConfig(TypedDict):
    """_decode_reduce_kernel's constexprs and launch option."""
    SPLITS_PAD: int
    D: int
    BLOCK_D: int
    num_warps: int


def decode_config(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, interpret: bool) -> DecodeConfig:
    """Constexprs and num_warps of _decode_partition_kernel; shared with the compile test."""
    group = num_heads // num_kv_heads
    return DecodeConfig(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=decode_block_n(head_dim), BLOCK_SIZE=block_size,
        UPCAST=interpret, PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=8,
    )


def reduce_config(head_dim: int, num_splits: int) -> ReduceConfig:
    return ReduceConfig(SPLITS_PAD=triton.next_power_of_2(num_splits), D=head_dim,
                        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1)


def decode_attention(
    out: torch.Tensor,  # [T, H, D]
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    q_rows: torch.Tensor,  # [B] int32: row of each decode sequence's token in q/out
    seq_lens: torch.Tensor,  # [B] int32, >= 1, including the new token
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    max_seq_len: int,  # >= every seq_len; sizes the split grid without a device sync
    # keys per split (multiple of decode_block_n); None: no split, no reduce
    partition: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([B, H, S, D], [B, H, S]) fp32
) -> None:
    """Attend one query token per sequence to its paged K/V. The backend picks partition once per
    step (TritonBackend: enough programs to fill the GPU); tests force small ones."""
    _, h, d = q.shape
    num_blocks, block_size, hkv, cd = k_cache.shape
    b = q_rows.numel()
    assert out.shape == q.shape and cd == d and h % hkv == 0 and v_cache.shape == k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert q_rows.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
    assert seq_lens.shape == (b,) and block_tables.dim() == 2 and block_tables.shape[0] == b
    assert block_tables.stride(1) == 1 and (partition is None or partition % decode_block_n(d) == 0)
    if b == 0:
        return
    one_split = partition is None or partition >= max_seq_len
    num_splits = 1 if one_split else triton.cdiv(max_seq_len, partition)
    if num_splits > 1:
        if workspace is None:
            workspace = (torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device),
                         torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device))
        part_out, part_lse = workspace
        assert part_out.shape == (b, h, num_splits, d) and part_lse.shape == (b, h, num_splits)
    else:
        part_out = part_lse = out  # unused
    _decode_partition_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, q_rows, seq_lens, block_tables,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        partition if num_splits > 1 else max_seq_len, num_splits,
        **decode_config(h, hkv, d, block_size, q.dtype, interpret=q.device.type != "cuda"),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(b, h)](
            out, part_out, part_lse, q_rows, seq_lens,
            out.stride(0), out.stride(1), h, partition, num_splits,
            **reduce_config(d, num_splits),
        )
