"""The physical KV memory: a device pool and a CPU swap pool, each one preallocated tensor for all
layers, sized once at start-up from a memory budget."""
from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from shared.config import CacheConfig, parse_memory

log = logging.getLogger("conveyor.kv_cache")


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


HUGE_PAGE = 2 << 20


def zeros_pool(shape: tuple[int, ...], dtype: torch.dtype, hugepages: bool) -> torch.Tensor:
    """A zero-filled CPU tensor for a KV pool. A decode step reads each layer's K/V as scattered
    6 KB blocks (~300 MB a step for SmolLM2 at 32 streams), about one TLB miss per block on 4 KB
    pages; so with hugepages the pool lies in 2 MB-aligned anonymous memory advised MADV_HUGEPAGE
    before its first touch (THP in "madvise" mode then maps it in 2 MB pages). Where the advice
    fails, plain memory."""
    if not hugepages or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        # private and anonymous (a shared mapping is shmem, which THP's madvise mode skips):
        # zero-filled, page-aligned
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds buf alive; zero_() touches every page now (as torch.zeros did), not mid-step
    pool = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=start)
    return pool.view(shape).zero_()


class KVCache:
    """device: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]; cpu: the same
    with num_cpu_blocks. In config.kv_cache_dtype, or the model's dtype when that is auto.

    Zero-filled: padded decode gathers read slots beyond a sequence's length; their attention
    weight is 0, but 0 * NaN from uninitialised memory would still poison the output.
    A CPU device pool asks for 2 MB pages (zeros_pool); CONVEYOR_KV_HUGEPAGES=0 turns that off.
    """

    def __init__(self, config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if config.kv_cache_dtype != "auto":
            dtype = getattr(torch, config.kv_cache_dtype)
        shape = (num_layers, 2, config.block_size, num_kv_heads, head_dim)
        per_block = (num_layers * 2 * config.block_size * num_kv_heads * head_dim
                     * torch.finfo(dtype).bits // 8)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = parse_memory(config.kv_cache_memory,
                                      total=available_memory(device)) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {config.kv_cache_memory!r} holds no block of "
                             f"{per_block} bytes")
        num_cpu = config.num_cpu_blocks
        if num_cpu is None:
            num_cpu = parse_memory(config.swap_space,
                                   total=available_memory(torch.device("cpu"))) // per_block
        self.block_size = config.block_size
        full = (*shape[:2], num_blocks, *shape[2:])
        if device.type == "cpu":
            hugepages = os.environ.get("CONVEYOR_KV_HUGEPAGES", "1") != "0"
            self.device = zeros_pool(full, dtype, hugepages)
        else:
            self.device = torch.zeros(full, dtype=dtype, device=device)
        # Pinned on CUDA so swaps are DMA copies; plain memory on a CPU-only machine.
        pin = device.type == "cuda"
        self.cpu = torch.zeros(*shape[:2], num_cpu, *shape[2:], dtype=dtype, pin_memory=pin)
        log.info("kv cache (%s): %d device blocks = %d tokens (%.0f MiB); swap pool: %d blocks = "
                 "%d tokens (%.0f MiB)", str(dtype).removeprefix("torch."), num_blocks,
                 num_blocks * self.block_size, num_blocks * per_block / 2**20, num_cpu,
                 num_cpu * self.block_size, num_cpu * per_block / 2**20)

    @property
    def num_blocks(self) -> int:
        return self.device.shape[2]

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu.shape[2]
