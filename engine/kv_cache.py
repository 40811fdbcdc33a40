"""The physical KV memory: one preallocated tensor for all layers, sized once from a memory budget."""
from __future__ import annotations

import logging

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


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def allocate_kv_cache(
    config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """-> [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]

    Zero-filled: padded decode gathers read slots beyond a sequence's length; their attention
    weight is 0, but 0 * NaN from uninitialised memory would still poison the output.
    """
    per_block = bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, dtype)
    num_blocks = config.num_blocks
    if num_blocks is None:
        num_blocks = parse_memory(config.kv_cache_memory, total=available_memory(device)) // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory!r} holds no block of {per_block} bytes")
    log.info("kv cache: %d blocks x %d tokens = %d tokens, %.1f MiB", num_blocks, config.block_size,
             num_blocks * config.block_size, num_blocks * per_block / 2**20)
    return torch.zeros(num_layers, 2, num_blocks, config.block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
