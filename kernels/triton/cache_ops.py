"""Cache writes and block moves: store new K/V through the slot mapping, copy blocks
(copy-on-write), and swap blocks between the device pool and the CPU swap pool.

All three are pure data movement: they are judged by bytes moved per second against a plain
device copy (bench/kernels.py), and the launchers keep every program's accesses contiguous.
"""
from __future__ import annotations

from typing import TypedDict

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # Triton types the arguments at launch
    k_ptr, v_ptr,  # [T, Hkv, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,  # D is unit-stride (asserted)
    stride_cb, stride_cs, stride_ch,  # cache strides (k and v caches share them, asserted)
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Grid (T,): one program per new token writes its [Hkv, D] key and value rows.
    # Traffic: reads 2*T*Hkv*D elements of k/v, writes as many into the cache, plus T slot ids.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padded token (e.g. a CUDA-graph batch): nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write each new token's K/V into its cache slot; slot -1 means skip (a padded token)."""
    t, hkv, d = k.shape  # [T, Hkv, D]
    num_blocks, block_size, chkv, cd = k_cache.shape  # [num_blocks, block_size, Hkv, D]
    assert v.shape == k.shape and (chkv, cd) == (hkv, d) and v_cache.shape == k_cache.shape
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    assert k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert slot_mapping.shape == (t,) and slot_mapping.dtype == torch.int64
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **store_config(hkv, d, block_size),
    )


class StoreConfig(TypedDict):
    """_store_kv_kernel's constexprs and launch option, passed as **config."""
    HKV: int
    D: int
    BLOCK_H: int
    BLOCK_D: int
    BLOCK_SIZE: int
    num_warps: int


class MoveConfig(TypedDict):
    """_move_blocks_kernel's constexpr and launch option."""
    BLOCK_E: int
    num_warps: int


def store_config(num_kv_heads: int, head_dim: int, block_size: int) -> StoreConfig:
    """Constexprs and num_warps of _store_kv_kernel; shared with the compile test."""
    return StoreConfig(HKV=num_kv_heads, D=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
                       BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, num_warps=4)


@triton.jit
def _move_blocks_kernel(  # type: ignore[no-untyped-def]  # Triton types the arguments at launch
    src_ptr, dst_ptr,  # [P, src_blocks, E] and [P, dst_blocks, E], P = layers * 2 planes
    src_idx_ptr, dst_idx_ptr,  # [N] int64
    src_plane_stride, dst_plane_stride, E,
    BLOCK_E: tl.constexpr,
):
    # Grid (N, P, cdiv(E, BLOCK_E)): program (i, p, c) copies chunk c of block src_idx[i] of plane p
    # onto block dst_idx[i]. A block of one plane is E = block_size*Hkv*D contiguous elements, so
    # every program reads and writes one contiguous BLOCK_E run. Traffic: 2 * N * P * E elements.
    i = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    src_block = tl.load(src_idx_ptr + i)
    dst_block = tl.load(dst_idx_ptr + i)
    e = c * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = e < E
    x = tl.load(src_ptr + p * src_plane_stride + src_block * E + e, mask=mask)
    tl.store(dst_ptr + p * dst_plane_stride + dst_block * E + e, x, mask=mask)


def _planes(kv: torch.Tensor) -> torch.Tensor:
    """[layers, 2, num_blocks, block_size, Hkv, D] -> [layers*2, num_blocks, E] without a copy."""
    assert kv.dim() == 6 and kv.is_contiguous(), "the KV pool must be one contiguous tensor"
    return kv.view(kv.shape[0] * 2, kv.shape[2], -1)


def _move_blocks(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
                 dst_idx: torch.Tensor) -> None:
    """dst[:, dst_idx[i]] = src[:, src_idx[i]] for [P, blocks, E] views on one device."""
    assert src.device == dst.device and src.dtype == dst.dtype
    assert src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2]
    assert src_idx.shape == dst_idx.shape and src_idx.dim() == 1
    n, (p, _, e) = src_idx.numel(), src.shape
    if n == 0:
        return
    src_idx = src_idx.to(device=src.device, dtype=torch.int64)
    dst_idx = dst_idx.to(device=src.device, dtype=torch.int64)
    config = move_config(e)
    grid = (n, p, triton.cdiv(e, config["BLOCK_E"]))
    _move_blocks_kernel[grid](src, dst, src_idx, dst_idx, src.stride(0), dst.stride(0), e, **config)


def move_config(block_elems: int) -> MoveConfig:
    """Constexprs and num_warps of _move_blocks_kernel: chunks of up to 4096 elements (8 KiB in
    bf16), 16 per thread at 8 warps: wide vector loads, enough programs for small moves."""
    return MoveConfig(BLOCK_E=min(4096, triton.next_power_of_2(block_elems)), num_warps=8)


def copy_blocks(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block src[i] onto dst[i] in every layer, K and V (copy-on-write).

    All programs run at once, so a dst block must not also be a src block (copy-on-write always
    copies onto a freshly allocated block); checked here when the ids are on the CPU (no sync).
    """
    if src.device.type == "cpu" and dst.device.type == "cpu":
        overlap = set(dst.tolist()) & set(src.tolist())
        assert not overlap, "copy_blocks: a dst block is also a src block"
    planes = _planes(kv)
    _move_blocks(planes, planes, src, dst)


def move_blocks(src_kv: torch.Tensor, dst_kv: torch.Tensor, src: torch.Tensor,
                dst: torch.Tensor) -> None:
    """Copy block src[i] of one pool onto block dst[i] of another pool on the same device."""
    _move_blocks(_planes(src_kv), _planes(dst_kv), src, dst)


def _staging(like: torch.Tensor, n: int, device: torch.device, pin: bool) -> torch.Tensor:
    p, _, e = like.shape
    return torch.empty(p, n, e, dtype=like.dtype, device=device, pin_memory=pin)


def swap_out(dev_kv: torch.Tensor, host_kv: torch.Tensor, src: torch.Tensor,
             dst: torch.Tensor) -> None:
    """Device pool -> CPU pool. A kernel cannot touch host memory, and many small block copies
    across PCIe would each pay a transfer's latency: gather the blocks on the device into one
    contiguous staging buffer (kernel), bring it over in one bulk copy into pinned memory, then
    scatter into the CPU pool with an indexed CPU copy."""
    dev, host = _planes(dev_kv), _planes(host_kv)
    n = src.numel()
    if n == 0:
        return
    staged = _staging(dev, n, dev.device, pin=False)  # [P, n, E] on the device
    _move_blocks(dev, staged, src, torch.arange(n, device=dev.device))
    pin = dev.device.type == "cuda"
    bounce = _staging(dev, n, host.device, pin=pin)  # [P, n, E] pinned on the host
    bounce.copy_(staged)  # one D2H transfer; synchronous, the CPU scatter below needs the data
    host.index_copy_(1, dst.to(device=host.device, dtype=torch.int64), bounce)


def swap_in(host_kv: torch.Tensor, dev_kv: torch.Tensor, src: torch.Tensor,
            dst: torch.Tensor) -> None:
    """CPU pool -> device pool: gather on the CPU into pinned staging, one bulk H2D copy, then a
    scatter kernel on the device (the mirror image of swap_out)."""
    host, dev = _planes(host_kv), _planes(dev_kv)
    n = src.numel()
    if n == 0:
        return
    pin = dev.device.type == "cuda"
    bounce = _staging(host, n, host.device, pin=pin)  # [P, n, E]
    torch.index_select(host, 1, src.to(device=host.device, dtype=torch.int64), out=bounce)
    # non_blocking from pinned memory is ordered before the scatter kernel on the same stream, and
    # the copy engine has read the bounce buffer before torch's caching host allocator reuses it.
    staged = bounce.to(dev.device, non_blocking=pin)
    _move_blocks(staged, dev, torch.arange(n, device=dev.device), dst)
