"""The attention backend interface: one Protocol, two implementations (torch on CPU and as the
oracle, Triton on GPU). The runner describes a step's batch once (BatchLayout); the backend turns
that into whatever metadata its kernels want (plan), once per step, then every layer calls forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class BatchLayout:
    """A step's varlen batch, sequence by sequence, in the order of the flattened tokens.

    Sequence i contributes query_lens[i] new tokens at positions context_lens[i] ..
    context_lens[i] + query_lens[i] - 1; its K/V for positions < context_lens[i] are already in
    the cache. block_tables[i] covers at least context_lens[i] + query_lens[i] tokens.
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    # [T] int64: cache slot (block_id * block_size + offset) of each new token
    slot_mapping: torch.Tensor

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]


class AttentionBackend(Protocol):
    # Whether the cache may hold K/V in another dtype than q (--kv-cache-dtype): the torch backend
    # casts; the Triton kernels take one dtype.
    casts_kv: bool
    # Whether forward honours `window` (sliding-window layers) and `softcap` (soft-capped scores).
    # An engine whose model needs one the backend lacks refuses to start (softcap) or caps its
    # context at the window.
    supports_window: bool
    supports_softcap: bool

    def plan(self, layout: BatchLayout) -> Any:
        """Build per-step metadata; called once per step, shared by all layers."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: Any, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] -> [T, H,
        D]. Write k/v into their cache slots, then attend each new token to its sequence's
        cached context (fully) and to the new tokens (causally). window: a token at position p
        sees only keys at p - window + 1 .. p. softcap: scores s become softcap * tanh(s /
        softcap) before the mask."""
        ...

    def copy_blocks(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """kv: [layers, 2, num_blocks, block_size, Hkv, D]; copy block src[i] onto dst[i] in every
        layer (copy-on-write)."""
        ...

    def swap_blocks(self, src_kv: torch.Tensor, dst_kv: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        """Copy blocks between pools (device <-> CPU swap pool); same layout as copy_blocks."""
        ...


def backend_limit(cfg: Any, backend: AttentionBackend) -> int:
    """The longest context `backend` serves `cfg` (an engine ModelConfig) exactly. A backend without
    sliding windows is exact up to the smallest window (where windowed and full attention agree);
    soft-capped scores it cannot compute at all, so that is refused rather than served wrong."""
    if cfg.attn_softcap is not None and not backend.supports_softcap:
        raise ValueError(f"{cfg.architecture} soft-caps attention scores, which the "
                         f"{type(backend).__name__} does not: use --attention-backend torch")
    windows = [w for w in cfg.layer_windows if w is not None]
    if windows and not backend.supports_window:
        return int(min(windows))
    return int(cfg.max_position_embeddings)
