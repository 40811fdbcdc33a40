"""Triton attention over the paged KV cache: the GPU path (and, under TRITON_INTERPRET=1, testable
on CPU against kernels/torch_backend.py).

Per layer, forward launches at most three kernels: store the new K/V through the slot mapping,
decode attention for the sequences with one new token (split-K over the KV length when the batch
alone cannot fill the GPU), and varlen prefill attention for the others. Two kernels rather than
one unified varlen kernel because the two cases want different shapes: decode is bound by
reading the cache and needs the split along the KV length to occupy the GPU at small batch,
while prefill tiles are compute-bound and already plentiful.

plan() turns the BatchLayout into int32 tensors once per step (one host-to-device copy);
whatever depends on the model's head layout (prefill work list, split-K workspace) is built on
the first layer's forward and reused by the other layers of the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from kernels.backend import BatchLayout
from kernels.triton import (
    copy_blocks,
    decode_attention,
    decode_block_n,
    device_arch,
    move_blocks,
    prefill_attention,
    prefill_block_q,
    prefill_knobs,
    prefill_tiles,
    store_kv,
    swap_in,
    swap_out,
)


@dataclass
class TritonMeta:
    slot_mapping: torch.Tensor  # [T] int64
    # The whole batch, in the order of the flattened tokens.
    # [B, max_blocks] int32, padded with block 0 (never read: loads are masked)
    block_tables: torch.Tensor
    seq_lens: torch.Tensor  # [B] int32 = context_lens + query_lens
    context_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    # Decode: sequences with query_len == 1.
    decode_rows: torch.Tensor  # [Bd] int32: their token's row in q
    decode_seq_lens: torch.Tensor  # [Bd] int32
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int32
    decode_max_len: int
    # Prefill: the others (fresh prompts, later chunks, prompts after a prefix-cache hit).
    prefill_q_start: torch.Tensor  # [Bp] int32
    prefill_q_lens: torch.Tensor  # [Bp] int32
    prefill_ctx_lens: torch.Tensor  # [Bp] int32
    prefill_block_tables: torch.Tensor  # [Bp, max_blocks] int32
    prefill_q_lens_list: list[int]
    # Built on the first layer's forward, shared by the step's layers: the split-K decode workspaces
    # (partial outputs, partial log-sum-exps) by (heads, head_dim, splits), the prefill tiles by
    # block_q.
    decode_workspaces: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False)
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False)

    @property
    def num_decodes(self) -> int:
        return self.decode_rows.numel()

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_q_lens_list)


class TritonBackend:
    """AttentionBackend on Triton kernels. min_partition and target_programs steer the decode
    split: split a sequence's keys only while the grid has fewer than target_programs programs
    (default two per streaming multiprocessor), and never into partitions under min_partition keys.
    """

    casts_kv = False
    # a windowed model serves contexts up to its smallest window (engine/core.py)
    supports_window = False
    supports_softcap = False

    def __init__(
        self, device: torch.device | str, min_partition: int = 256,
        target_programs: int | None = None
    ) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda" and not triton.knobs.runtime.interpret:
            raise ValueError("the Triton attention backend needs a CUDA device, not "
                             f"{self.device}: use --attention-backend torch (or auto) there; on "
                             "CPU Triton runs only under TRITON_INTERPRET=1, which the tests use")
        if target_programs is None:
            cuda = self.device.type == "cuda"
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 4
            target_programs = 2 * sms
        self.min_partition = min_partition
        self.target_programs = target_programs

    def plan(self, layout: BatchLayout) -> TritonMeta:
        q_lens, ctx_lens, bs = layout.query_lens, layout.context_lens, layout.block_size
        b = len(q_lens)
        seq_lens = layout.seq_lens
        max_blocks = max([triton.cdiv(n, bs) for n in seq_lens], default=0)
        tables = torch.zeros(b, max(max_blocks, 1), dtype=torch.int32)  # [B, max_blocks]
        for i, (table, n) in enumerate(zip(layout.block_tables, seq_lens)):
            used = table[: triton.cdiv(n, bs)]
            covered = len(used) * bs
            assert covered >= n, f"sequence {i}: block table covers {covered} < {n} tokens"
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.int32)
        q_start = [0]
        for n in q_lens:
            q_start.append(q_start[-1] + n)
        dec = [i for i, n in enumerate(q_lens) if n == 1]
        pre = [i for i, n in enumerate(q_lens) if n != 1]
        dec_t, pre_t = torch.tensor(dec, dtype=torch.int64), torch.tensor(pre, dtype=torch.int64)
        seq_t, ctx_t, start_t = (torch.tensor(x, dtype=torch.int32)
                                 for x in (seq_lens, ctx_lens, q_start))
        host = {
            "block_tables": tables,
            "seq_lens": seq_t,
            "context_lens": ctx_t,
            "query_start_loc": start_t,
            "decode_rows": start_t[dec_t],
            "decode_seq_lens": seq_t[dec_t],
            "decode_block_tables": tables[dec_t],
            "prefill_q_start": start_t[pre_t],
            "prefill_q_lens": torch.tensor([q_lens[i] for i in pre], dtype=torch.int32),
            "prefill_ctx_lens": ctx_t[pre_t],
            "prefill_block_tables": tables[pre_t],
        }
        dev = self._to_device(host)
        return TritonMeta(
            slot_mapping=layout.slot_mapping.to(self.device, torch.int64),
            decode_max_len=max([seq_lens[i] for i in dec], default=0),
            prefill_q_lens_list=[q_lens[i] for i in pre],
            **dev,
        )

    def _to_device(self, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One host-to-device copy for all of a step's int32 metadata, then views of it."""
        flat = torch.cat([t.flatten() for t in host.values()])
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        out, offset = {}, 0
        for name, t in host.items():
            out[name] = flat[offset: offset + t.numel()].view(t.shape)
            offset += t.numel()
        return out

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: TritonMeta,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        # [T, H, D]; a caller-owned buffer (CUDA graphs, tests that poison it)
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # the engine checks supports_* before it starts
        if window is not None or softcap is not None:
            raise NotImplementedError("the Triton kernels attend without sliding windows or "
                                      "soft-capping")
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        _, h, d = q.shape
        hkv = k_cache.shape[2]
        if meta.num_decodes:
            partition = self._decode_partition(meta.num_decodes, hkv, meta.decode_max_len,
                                               decode_block_n(d))
            workspace = None
            if partition is not None:
                splits: int = triton.cdiv(meta.decode_max_len, partition)
                workspace = meta.decode_workspaces.get((h, d, splits))
                if workspace is None:
                    bd = meta.num_decodes
                    workspace = meta.decode_workspaces[(h, d, splits)] = (
                        torch.empty(bd, h, splits, d, dtype=torch.float32, device=q.device),
                        torch.empty(bd, h, splits, dtype=torch.float32, device=q.device))
            decode_attention(out, q, k_cache, v_cache, meta.decode_rows, meta.decode_seq_lens,
                             meta.decode_block_tables, scale, meta.decode_max_len, partition,
                             workspace)
        if meta.num_prefills:
            # The tiles must match the launch's BLOCK_Q.
            knobs = prefill_knobs(device_arch(q.device), d, q.dtype, h // hkv)
            block_q = prefill_block_q(h, hkv, q.dtype, knobs.block_m)
            tiles = meta.tiles.get(block_q)
            if tiles is None:
                seqs, starts = prefill_tiles(meta.prefill_q_lens_list, block_q)
                tiles = meta.tiles[block_q] = (torch.tensor(seqs, dtype=torch.int32).to(q.device),
                                               torch.tensor(starts, dtype=torch.int32).to(q.device))
            tile_seq, tile_start = tiles
            prefill_attention(out, q, k_cache, v_cache, tile_seq, tile_start, meta.prefill_q_start,
                              meta.prefill_q_lens, meta.prefill_ctx_lens, meta.prefill_block_tables,
                              scale, knobs)
        return out

    def _decode_partition(self, batch: int, num_kv_heads: int, max_len: int,
                          block_n: int) -> int | None:
        """Keys per split, or None for no split: split only while (sequences x KV heads) programs
        leave the GPU under-occupied, so large batches pay no reduce step."""
        programs = batch * num_kv_heads
        if programs >= self.target_programs or max_len <= self.min_partition:
            return None
        splits: int = min(triton.cdiv(self.target_programs, programs),
                          triton.cdiv(max_len, self.min_partition))
        if splits <= 1:
            return None
        tiles_per_split: int = triton.cdiv(triton.cdiv(max_len, splits), block_n)
        return tiles_per_split * block_n

    def copy_blocks(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """kv: [layers, 2, num_blocks, block_size, Hkv, D]; block src[i] -> dst[i]
        (copy-on-write)."""
        copy_blocks(kv, src, dst)

    def swap_blocks(self, src_kv: torch.Tensor, dst_kv: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        """Between pools: same device -> one copy kernel; device -> CPU -> gather kernel, one bulk
        copy, CPU scatter (swap_out); CPU -> device -> the mirror image (swap_in)."""
        if src_kv.device == dst_kv.device:
            move_blocks(src_kv, dst_kv, src, dst)
        elif dst_kv.device.type == "cpu":
            swap_out(src_kv, dst_kv, src, dst)
        else:
            swap_in(src_kv, dst_kv, src, dst)
