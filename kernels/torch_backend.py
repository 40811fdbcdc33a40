"""PyTorch attention over the paged KV cache: the CPU path and the oracle for the Triton kernels.

Decode tokens (query length 1) of all sequences go through one batched SDPA per layer: the
per-step plan turns block tables into one padded list of block ids, so each layer gathers whole
blocks (contiguous block_size * Hkv * D runs, 3x faster than gathering slot by slot) and makes one
attention call instead of a Python loop over sequences. Grouped-query heads ride in SDPA's query
length: q [B, Hkv, G, D] against k [B, Hkv, L, D], so K/V are never expanded to all heads.
Prefill chunks are few per step and run one SDPA each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import BatchLayout


@dataclass
class _Prefill:
    token_slice: slice  # rows of this sequence's new tokens in the flattened batch
    key_slots: torch.Tensor  # [L] int64 slots of positions 0..L-1
    mask: torch.Tensor | None  # [q, L] float additive (0 / -inf), None without cached context (plain causal)


@dataclass
class TorchMeta:
    slot_mapping: torch.Tensor  # [T]
    decode_rows: torch.Tensor | None  # [Bd] rows of decode tokens in the flattened batch
    decode_blocks: torch.Tensor | None  # [Bd * nblk] int64 block ids, padded with block 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, nblk * block_size] bool, True where a key is valid
    all_decode: bool
    prefills: list[_Prefill]


def slots_of(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..length-1 of a sequence. -> [length] int64"""
    blocks = torch.tensor(block_table[: (length + block_size - 1) // block_size], dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return slots[:length]


class TorchBackend:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def plan(self, layout: BatchLayout) -> TorchMeta:
        bs = layout.block_size
        decode_idx, prefills, start = [], [], 0
        for i, (q, ctx) in enumerate(zip(layout.query_lens, layout.context_lens)):
            if q == 1:
                decode_idx.append(i)
            else:
                L = ctx + q
                mask = None
                if ctx > 0:  # query j sits at position ctx + j and sees keys 0..ctx + j
                    # Additive float mask: CPU SDPA runs about 2x faster with it than with a bool mask.
                    hidden = torch.arange(L)[None, :] > (torch.arange(q)[:, None] + ctx)
                    mask = torch.zeros(q, L).masked_fill_(hidden, float("-inf")).to(self.device)
                prefills.append(_Prefill(slice(start, start + q), slots_of(layout.block_tables[i], L, bs).to(self.device), mask))
            start += q
        rows = blocks = mask = None
        if decode_idx:
            lens = [layout.context_lens[i] + 1 for i in decode_idx]
            nblk = (max(lens) + bs - 1) // bs
            flat: list[int] = []
            for i in decode_idx:
                bt = layout.block_tables[i][:nblk]
                flat += bt
                flat += [0] * (nblk - len(bt))
            blocks = torch.tensor(flat, dtype=torch.int64)
            mask = (torch.arange(nblk * bs)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
            qstarts = torch.tensor(layout.query_lens).cumsum(0) - 1
            rows = qstarts[torch.tensor(decode_idx)]
            rows, blocks, mask = rows.to(self.device), blocks.to(self.device), mask.to(self.device)
        return TorchMeta(
            slot_mapping=layout.slot_mapping.to(self.device),
            decode_rows=rows,
            decode_blocks=blocks,
            decode_mask=mask,
            all_decode=not prefills,
            prefills=prefills,
        )

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMeta, scale: float) -> torch.Tensor:
        num_blocks, block_size, hkv, d = k_cache.shape
        k_flat = k_cache.view(num_blocks * block_size, hkv, d)  # [S, Hkv, D]
        v_flat = v_cache.view(num_blocks * block_size, hkv, d)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        gqa = q.shape[1] != hkv
        out = q.new_empty(q.shape) if not meta.all_decode else None
        if meta.decode_rows is not None:
            qd = q if meta.all_decode else q[meta.decode_rows]  # [Bd, H, D]
            bd, h = qd.shape[0], qd.shape[1]
            qd = qd.reshape(bd, hkv, h // hkv, d)  # [Bd, Hkv, G, D]: query heads grouped by their KV head
            kd = k_cache.index_select(0, meta.decode_blocks).view(bd, -1, hkv, d).transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = v_cache.index_select(0, meta.decode_blocks).view(bd, -1, hkv, d).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
            od = od.reshape(bd, h, d)  # [Bd, H, D]
            if meta.all_decode:
                return od
            out[meta.decode_rows] = od
        for p in meta.prefills:
            # 4-D [1, H, L, D]: 3-D inputs take SDPA's slow fallback on CPU (4-5x slower at 512 tokens).
            qp = q[p.token_slice].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            kp = k_flat.index_select(0, p.key_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vp = v_flat.index_select(0, p.key_slots).transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa
            )
            out[p.token_slice] = op[0].transpose(0, 1)
        return out

    def copy_blocks(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv[:, :, dst] = kv[:, :, src]

    def swap_blocks(self, src_kv: torch.Tensor, dst_kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst_kv[:, :, dst.to(dst_kv.device)] = src_kv[:, :, src.to(src_kv.device)].to(dst_kv.device)
