"""Cache writes and block moves (store through the slot mapping, copy-on-write copies, swap between
pools) against the PyTorch backend, under TRITON_INTERPRET=1 in a worker process.

These are pure copies, so they are exact in every dtype, bfloat16 included (the interpreter's
bf16 trouble is tl.dot only), and are compared bit for bit with NaN-poisoned destinations.
"""
from __future__ import annotations

import pytest
import torch

from kernels.torch_backend import TorchBackend
from tests.kernels.triton_worker import run_isolated

DTYPES = ["float32", "bfloat16"]


def _exact(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _case_store(dtype: str, head_dim: int, block_size: int, num_kv_heads: int) -> None:
    from kernels.triton import store_kv

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(head_dim + block_size + num_kv_heads)
    num_blocks, t, hkv, d = 6, 23, num_kv_heads, head_dim
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dt)
    v_cache = torch.full_like(k_cache, float("nan"))
    # K and V as views of a fused projection output (row stride 3*Hkv*D, not Hkv*D).
    kv = torch.randn(t, 3 * hkv * d, generator=gen).to(dt)
    k, v = kv[:, : hkv * d].view(t, hkv, d), kv[:, hkv * d: 2 * hkv * d].view(t, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]  # scattered over every block
    slots[[3, 11]] = -1  # padded tokens: not stored
    store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = (torch.full_like(k_cache, float("nan")) for _ in range(2))
    keep = slots >= 0
    want_k.view(-1, hkv, d)[slots[keep]] = k[keep]
    want_v.view(-1, hkv, d)[slots[keep]] = v[keep]
    _exact(k_cache, want_k)
    _exact(v_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size,num_kv_heads",
                         [(64, 16, 1), (128, 32, 4), (80, 16, 3)])
def test_store_kv(dtype: str, head_dim: int, block_size: int, num_kv_heads: int) -> None:
    """Every new token lands in its slot and nowhere else; slot -1 is skipped; padded head dims."""
    run_isolated(_case_store, dtype=dtype, head_dim=head_dim, block_size=block_size,
                 num_kv_heads=num_kv_heads)


def _pool(gen: torch.Generator, dt: torch.dtype, num_blocks: int,
          block_size: int = 16) -> torch.Tensor:
    # [layers, 2, blocks, bs, Hkv, D]
    return torch.randn(3, 2, num_blocks, block_size, 2, 64, generator=gen).to(dt)


def _case_copy_blocks(dtype: str) -> None:
    from kernels.triton_backend import TritonBackend

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1)
    kv = _pool(gen, dt, 12)
    perm = torch.randperm(12, generator=gen)
    src, dst = perm[:4], perm[4:8]
    kv[:, :, dst] = float("nan")  # poisoned: an uncopied block stays NaN
    want = kv.clone()
    TorchBackend("cpu").copy_blocks(want, src, dst)
    TritonBackend("cpu").copy_blocks(kv, src, dst)
    _exact(kv, want)
    assert not torch.isnan(kv[:, :, dst]).any()
    # One source copied to two destinations (two sequences forked from one block).
    src2, dst2 = torch.tensor([src[0], src[0]]), perm[8:10]
    TorchBackend("cpu").copy_blocks(want, src2, dst2)
    TritonBackend("cpu").copy_blocks(kv, src2, dst2)
    _exact(kv, want)
    with pytest.raises(AssertionError, match="also a src"):
        TritonBackend("cpu").copy_blocks(kv, torch.tensor([1, 2]), torch.tensor([2, 3]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype: str) -> None:
    """Copy-on-write: every layer's K and V block src[i] lands on dst[i]; nothing else changes."""
    run_isolated(_case_copy_blocks, dtype=dtype)


def _case_swap(dtype: str) -> None:
    from kernels.triton import swap_in, swap_out
    from kernels.triton_backend import TritonBackend

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(2)
    device_pool, host_pool = _pool(gen, dt, 10), torch.full((3, 2, 7, 16, 2, 64), float("nan"),
                                                            dtype=dt)
    src = torch.randperm(10, generator=gen)[:5]
    dst = torch.randperm(7, generator=gen)[:5]
    # Through the backend (both pools on the CPU here: the same-device kernel path).
    for fn in (TritonBackend("cpu").swap_blocks, swap_out):
        got, want = host_pool.clone(), host_pool.clone()
        fn(device_pool, got, src, dst)
        TorchBackend("cpu").swap_blocks(device_pool, want, src, dst)
        _exact(got, want)
        assert not torch.isnan(got[:, :, dst]).any()
    # And back in, onto poisoned device blocks: the round trip restores the blocks.
    host = host_pool.clone()
    swap_out(device_pool, host, src, dst)
    back_dst = torch.randperm(10, generator=gen)[:5]
    for swap_back in (TritonBackend("cpu").swap_blocks, swap_in):
        got = device_pool.clone()
        got[:, :, back_dst] = float("nan")
        want = got.clone()
        swap_back(host, got, dst, back_dst)
        TorchBackend("cpu").swap_blocks(host, want, dst, back_dst)
        _exact(got, want)
        _exact(got[:, :, back_dst], device_pool[:, :, src])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks(dtype: str) -> None:
    """Swap out and in: the backend's same-device path and the staging path (gather kernel, one
    bulk copy, indexed CPU copy) both match TorchBackend.swap_blocks."""
    run_isolated(_case_swap, dtype=dtype)


def _case_empty() -> None:
    from kernels.triton import store_kv
    from kernels.triton_backend import TritonBackend

    kv = torch.randn(1, 2, 4, 16, 1, 16)
    none = torch.tensor([], dtype=torch.int64)
    before = kv.clone()
    TritonBackend("cpu").copy_blocks(kv, none, none)
    TritonBackend("cpu").swap_blocks(kv, kv.clone(), none, none)
    store_kv(torch.empty(0, 1, 16), torch.empty(0, 1, 16), kv[0, 0], kv[0, 1], none)
    _exact(kv, before)


def test_empty_lists_launch_nothing() -> None:
    """Steps with nothing to copy, swap or store are no-ops (no zero-size grid launch)."""
    run_isolated(_case_empty)
