"""Random paged batches for the kernel tests: scrambled block tables and a poisoned cache.

Every cache slot that holds no position of any sequence is NaN (unused blocks, the tail of each
last block, the slots the new tokens will be stored to), so a kernel that reads a wrong slot, or
a store that misses one, turns the result into NaN. The PyTorch oracle's padded gathers do read
such slots (and mask them), so it runs on a copy with the NaNs replaced by zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.backend import BatchLayout


@dataclass
class PagedBatch:
    layout: BatchLayout
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], poisoned
    v_cache: torch.Tensor

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def clean_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches with NaN -> 0, for the oracle."""
        return (torch.nan_to_num(self.k_cache.clone(), nan=0.0),
                torch.nan_to_num(self.v_cache.clone(), nan=0.0))

    def stored_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the poisoned caches must look like after the new K/V are stored: exactly that."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        nb, bs, hkv, d = kc.shape
        kc.view(nb * bs, hkv, d)[self.layout.slot_mapping] = self.k
        vc.view(nb * bs, hkv, d)[self.layout.slot_mapping] = self.v
        return kc, vc


def random_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Sequence i has context_lens[i] cached tokens and query_lens[i] new ones; its blocks are
    drawn from a random permutation of the pool, so tables are scrambled and never contiguous."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // block_size) for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at: at + n])
        at += n
    hkv, h, d, t = num_kv_heads, num_kv_heads * group, head_dim, sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache, v_cache = randn(num_blocks, block_size, hkv, d), randn(num_blocks, block_size, hkv, d)
    cached = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    slots = []
    for table, q, c in zip(tables, query_lens, context_lens):
        for pos in range(c + q):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < c:
                cached[slot] = True
            else:
                slots.append(slot)
    for cache in (k_cache, v_cache):
        cache.view(-1, hkv, d)[~cached] = float("nan")
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    layout = BatchLayout(list(query_lens), list(context_lens), tables, block_size, slot_mapping)
    return PagedBatch(layout, randn(t, h, d), randn(t, hkv, d), randn(t, hkv, d), k_cache, v_cache)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float64; NaN anywhere in out gives inf."""
    if torch.isnan(out).any():
        return float("inf")
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
