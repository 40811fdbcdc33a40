"""The KV pool on 2 MB pages (engine.kv_cache.zeros_pool): the same zero-filled tensor as
torch.zeros, on huge pages where the kernel gives them, and plain memory where the advice fails."""
from __future__ import annotations

import errno
import mmap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.kv_cache as kv_cache
from engine.kv_cache import HUGE_PAGE, KVCache, zeros_pool
from shared.config import CacheConfig

SHAPE = (2, 2, 700, 16, 3, 64)  # ~8.6 MB in bfloat16: several huge pages


def huge_kib(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ptr, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def thp_fallbacks() -> int:
    """The kernel's count of huge-page faults that fell back to small pages (/proc/vmstat)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hugepages", [True, False])
def test_the_pool_is_a_writable_zero_tensor_of_its_shape(dtype: torch.dtype,
                                                         hugepages: bool) -> None:
    pool = zeros_pool(SHAPE, dtype, hugepages)
    assert pool.shape == SHAPE and pool.dtype == dtype and pool.is_contiguous()
    assert torch.equal(pool, torch.zeros(SHAPE, dtype=dtype))
    pool[1, 0, 699, 15, 2, 63] = 3.0  # the last element: the view covers the whole pool
    pool[0, 1, 5].fill_(-1.0)
    assert pool.double().sum().item() == 3.0 - 16 * 3 * 64


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled")
                    .read_text(), reason="transparent huge pages are off on this kernel")
def test_the_pool_lies_on_huge_pages_where_the_kernel_has_them() -> None:
    fallbacks = thp_fallbacks()
    pool = zeros_pool(SHAPE, torch.bfloat16, True)
    assert pool.data_ptr() % HUGE_PAGE == 0
    if huge_kib(pool.data_ptr()) == 0 and thp_fallbacks() > fallbacks:
        # the advice was taken, but the kernel had no free 2 MB page to give (a fragmented host)
        pytest.skip("the kernel fell back to 4 KB pages for want of a free huge page")
    assert huge_kib(pool.data_ptr()) >= HUGE_PAGE // 1024
    plain = zeros_pool(SHAPE, torch.bfloat16, False)
    assert huge_kib(plain.data_ptr()) == 0 or plain.data_ptr() % HUGE_PAGE != 0


class Refused(mmap.mmap):
    """An anonymous mapping whose madvise fails, as on a kernel without THP."""

    def madvise(self, *args: Any) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")


def test_a_refused_advice_gives_a_plain_zero_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.SimpleNamespace(mmap=Refused, MADV_HUGEPAGE=mmap.MADV_HUGEPAGE,
                                 MAP_PRIVATE=mmap.MAP_PRIVATE, MAP_ANONYMOUS=mmap.MAP_ANONYMOUS)
    monkeypatch.setattr(kv_cache, "mmap", fake)
    pool = zeros_pool(SHAPE, torch.bfloat16, True)
    assert pool.shape == SHAPE and torch.equal(pool, torch.zeros(SHAPE, dtype=torch.bfloat16))
    pool.fill_(1.0)
    monkeypatch.setattr(kv_cache, "mmap", types.SimpleNamespace())  # no MADV_HUGEPAGE at all
    assert torch.equal(zeros_pool(SHAPE, torch.float32, True), torch.zeros(SHAPE))


@pytest.mark.parametrize("setting, huge", [("0", False), ("1", True), (None, True)])
def test_the_env_var_turns_the_huge_pages_off(monkeypatch: pytest.MonkeyPatch, setting: str | None,
                                              huge: bool) -> None:
    asked: list[bool] = []

    def spy(shape: tuple[int, ...], dtype: torch.dtype, hugepages: bool) -> torch.Tensor:
        asked.append(hugepages)
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(kv_cache, "zeros_pool", spy)
    if setting is None:
        monkeypatch.delenv("CONVEYOR_KV_HUGEPAGES", raising=False)
    else:
        monkeypatch.setenv("CONVEYOR_KV_HUGEPAGES", setting)
    cache = KVCache(CacheConfig(num_blocks=8, num_cpu_blocks=2), 2, 3, 64, torch.bfloat16,
                    torch.device("cpu"))
    assert asked == [huge] and cache.device.shape == (2, 2, 8, 16, 3, 64)
    assert cache.num_blocks == 8 and cache.num_cpu_blocks == 2
