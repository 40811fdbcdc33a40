"""PyTorch attention over the paged KV cache: the CPU path and the oracle for the Triton kernels.

With native=True (`--attention-backend cpu`, the default on CPUs) the decodes and short queries of every
step go to the native kernel of kernels/cpu, which reads K/V blocks where they lie; prompt chunks still
take SDPA, where the work is GEMM-shaped.
Otherwise:

Short queries go through batched SDPA calls per layer: decode tokens (query length 1) in one, and
queries of 2..SHORT_QUERY tokens over a cached context (speculative verification, the tail of a
chunked prompt) in another, padded to the longest. The per-step plan turns block tables into one
padded list of block ids, so each layer gathers whole blocks (contiguous block_size * Hkv * D runs
instead of one slot at a time) and makes one attention call instead of a Python loop over
sequences. Sequences whose contexts differ a lot go into separate calls (buckets by length), since
padding every context to the longest one gathers and attends blocks no query sees. Gathers land in
a workspace reused across layers and steps, because a fresh tensor of tens of MB is mapped and
page-faulted in on every call. Grouped-query heads ride in SDPA's query length: q [B, Hkv, Q * G, D]
against k [B, Hkv, L, D], so K/V are never expanded to all heads. Longer prompt chunks are few per
step and run one SDPA each. What each of these choices measured: docs/performance.md, "CPU attention".
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.backend import BatchLayout

# Queries up to this long over a cached context are batched (padded) instead of run one by one.
SHORT_QUERY = 16
# Padded blocks a separate attention call must save before a batch is split by context length: one more
# call per layer (gathers, SDPA, scatter) costs about as much as gathering and attending this many K/V
# blocks of SmolLM2-135M (bench: python bench/cpu_attention.py).
SPLIT_COST_BLOCKS = 16
# A new call starts at a context this much shorter than the current call's longest, so no sequence is
# padded by more than 1 / SPLIT_RATIO and the calls' lengths fall geometrically.
SPLIT_RATIO = 0.7
# At most this many calls per group and layer, however spread the contexts are.
MAX_BUCKETS = 8


@dataclass
class _Prefill:
    token_slice: slice  # rows of this sequence's new tokens in the flattened batch
    key_slots: torch.Tensor  # [L] int64 slots of positions 0..L-1
    mask: torch.Tensor | None  # [q, L] (prefix_mask), None without cached context (plain causal)
    context: int = 0  # cached tokens before the first query
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its [q, L] mask

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The causal mask, narrowed to the last `window` keys of each query (built once per step and
        window, then shared by every layer with that window)."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            q, L = self.token_slice.stop - self.token_slice.start, self.key_slots.numel()
            qpos = torch.arange(q)[:, None] + self.context  # [q, 1] positions of the queries
            key = torch.arange(L)[None, :]
            hidden = (key > qpos) | (key <= qpos - window)  # transformers: visible iff q - window < key <= q
            self.windowed[window] = prefix_mask(hidden, self.key_slots.device)
        return self.windowed[window]


def prefix_mask(hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    """hidden [q, L] bool (True = masked) -> the mask SDPA takes on device. On the CPU an additive float
    mask (its flash kernel runs that faster than a bool one: docs/performance.md); elsewhere a bool mask,
    True = visible: CUDA's SDPA kernels want a float mask in the query's dtype and misread a float32 one
    under bfloat16 queries (bench/kernels.py measured a relative error of 0.9 before)."""
    if device.type == "cpu":
        return torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    return (~hidden).to(device)


@dataclass
class _Batched:
    """B sequences with queries of at most q_len tokens, attended in one padded SDPA call."""

    q_len: int
    rows: torch.Tensor  # [B * q_len] rows of the flattened batch; padding repeats a sequence's last row
    blocks: torch.Tensor  # [B * nblk] int64 block ids, padded with block 0
    mask: torch.Tensor  # [B, 1, q_len, 1, nblk * block_size] bool, True where query j may see key p
    keep: torch.Tensor | None  # [n] positions in rows that are real queries; None when all are
    positions: torch.Tensor  # [B, q_len] int64 position of each query (padding repeats the last)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> its mask

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self.windowed:
            key = torch.arange(self.mask.shape[-1], device=self.mask.device)  # [L] key positions
            near = key[None, None, :] > self.positions[:, :, None] - window  # [B, q_len, L]
            self.windowed[window] = self.mask & near[:, None, :, None, :]
        return self.windowed[window]


@dataclass
class _Native:
    """Sequences with short queries, for one call of the native kernel (int32, one entry per sequence)."""

    block_tables: torch.Tensor  # [S, max blocks], padded with block 0
    q_start: torch.Tensor  # [S] row of the sequence's first query in the flattened batch
    q_len: torch.Tensor  # [S]
    seq_len: torch.Tensor  # [S] context + query length
    covers_all: bool  # the sequences' rows are every row of the batch


@dataclass
class TorchMeta:
    slot_mapping: torch.Tensor  # [T]
    batched: list[_Batched]
    all_decode: bool  # every row is a decode token, in order: one batched call covers the step
    prefills: list[_Prefill]
    native: _Native | None = None  # set instead of batched when the native kernel runs short queries


def slots_of(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..length-1 of a sequence. -> [length] int64"""
    blocks = torch.tensor(block_table[: (length + block_size - 1) // block_size], dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return slots[:length]


def buckets(num_blocks: list[int]) -> list[list[int]]:
    """Split sequences needing num_blocks[i] blocks into groups attended in one padded call each: walking
    from the longest, start a new group at a sequence SPLIT_RATIO times the group's longest or shorter,
    where padding it and the rest to that longest would waste at least SPLIT_COST_BLOCKS.
    -> groups of indices, each in ascending order."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__, reverse=True)
    groups, longest = [[order[0]]], num_blocks[order[0]]
    for pos in range(1, len(order)):
        i = order[pos]
        saved = (longest - num_blocks[i]) * (len(order) - pos)
        if num_blocks[i] <= SPLIT_RATIO * longest and saved >= SPLIT_COST_BLOCKS and len(groups) < MAX_BUCKETS:
            groups.append([])
            longest = num_blocks[i]
        groups[-1].append(i)
    return [sorted(g) for g in groups]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
              scale: float, gqa: bool, softcap: float | None) -> torch.Tensor:
    """SDPA, or where scores are soft-capped (Gemma 2: cap * tanh(s / cap) before the mask) the same
    attention written out, in transformers' order of operations, with the softmax in float32.
    q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask bool (True = visible) or additive -> [B, H, Lq, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if gqa:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)).float() * scale  # [B, H, Lq, Lk]
    s = torch.tanh(s / softcap) * softcap
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(s.shape[-1] - s.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.softmax(s, dim=-1).to(v.dtype) @ v


class TorchBackend:
    # Sliding windows and soft-capped scores are honoured per call (Gemma 2/3, Mistral, Phi-3).
    supports_window = True
    supports_softcap = True
    # K/V may be stored in bfloat16 under a float32 model: stores cast down; decode and short queries attend
    # in the cache's dtype (half the bytes to gather and read); prompt chunks, bound by arithmetic, upcast.
    casts_kv = True

    # Context tokens per task of the native kernel: a long sequence is split so both cores share it.
    NATIVE_PART_TOKENS = 256

    def __init__(self, device: torch.device | str = "cpu", native: bool = False,
                 native_max_context: int | None = None, dtype: torch.dtype | None = None,
                 native_prompts: bool | None = None) -> None:
        """native: decodes and short queries through the native CPU kernel, where it builds (kernels.cpu).
        native_max_context: the most context tokens a step's short queries may attend for the native kernel
        to take them; None (the default): no limit. The kernel beats gather + SDPA at every batch and context
        measured, in bfloat16 and float32, on AVX-512 and AVX2 CPUs (python bench/cpu_attention.py --native);
        the knob stays for bench/step_profile.py --native-max-context, to time the old path beside it.
        dtype: the model's, where known: prompt chunks go native where that pays (below).
        native_prompts: True puts prompt chunks on the native kernel wherever it runs (--deterministic);
        None decides as below."""
        self.device = torch.device(device)
        self.native_max_context = native_max_context
        # The native kernel's code path: auto (the best this CPU runs) or portable | avx2 | avx512 |
        # avx512_bf16 (docs/kernels.md); CONVEYOR_ATTENTION_ISA names one for a bench's side-by-side run.
        self.native_isa = os.environ.get("CONVEYOR_ATTENTION_ISA", "auto")
        self._workspace = torch.empty(0, device=self.device)  # gathered K then V, grown as needed
        if native and self.device.type == "cpu":
            from kernels import cpu

            native = cpu.available()
        self.native = native and self.device.type == "cpu"
        # Prompt chunks through the native kernel too, where it beats SDPA (bench/cpu_attention.py --native):
        # with its AVX-512 BF16 path, i.e. a bfloat16 model and cache on a CPU with avx512_bf16. (With AMX,
        # SDPA's flash kernel runs a lone prompt 3-4x faster, but served steps mix prompt chunks with decodes,
        # and there the one native call per step served more: docs/performance.md, "The AMX Xeon".) One
        # kernel for every row walks each row's context in one fixed order, so a token's output does not
        # depend on how its prompt was chunked or cached (issue #30); --deterministic asks for it wherever the
        # native kernel runs. CONVEYOR_NATIVE_PROMPTS=1|0 forces it on or off.
        # Asked only where the native kernel runs: elsewhere (CUDA, the torch backend) its library may not
        # be loaded at all.
        forced = os.environ.get("CONVEYOR_NATIVE_PROMPTS")
        if not self.native:
            self.native_prompts = False
        elif native_prompts is not None:
            self.native_prompts = native_prompts
        elif forced in ("0", "1"):
            self.native_prompts = forced == "1"
        else:
            self.native_prompts = self._bf16_path(dtype)

    def _bf16_path(self, dtype: torch.dtype | None) -> bool:
        """Whether the native kernel runs its AVX-512 BF16 path for this model (head dim aside)."""
        return (dtype == torch.bfloat16 and self.native_isa in ("auto", "avx512_bf16")
                and "avx512_bf16" in torch.ops.conveyor_cpu.attention_isas())

    def plan(self, layout: BatchLayout) -> TorchMeta:
        bs = layout.block_size
        decode, short, prefills, start = [], [], [], 0
        for i, (q, ctx) in enumerate(zip(layout.query_lens, layout.context_lens)):
            if q == 1:
                decode.append((i, start))
            elif (q <= SHORT_QUERY and ctx > 0) or (self.native and self.native_prompts):
                short.append((i, start))
            else:
                L = ctx + q
                mask = None
                if ctx > 0:  # query j sits at position ctx + j and sees keys 0..ctx + j
                    mask = prefix_mask(torch.arange(L)[None, :] > (torch.arange(q)[:, None] + ctx), self.device)
                slots = slots_of(layout.block_tables[i], L, bs).to(self.device)
                prefills.append(_Prefill(slice(start, start + q), slots, mask, ctx))
            start += q
        if self.native and (decode or short) and self._few_tokens(layout, decode + short):
            return TorchMeta(slot_mapping=layout.slot_mapping.to(self.device), batched=[], all_decode=False,
                             prefills=prefills, native=self._native(layout, sorted(decode + short), prefills))
        batched = []
        for group in (decode, short):
            if group:
                need = [(layout.context_lens[i] + layout.query_lens[i] + bs - 1) // bs for i, _ in group]
                batched += [self._batched(layout, [group[j] for j in b]) for b in buckets(need)]
        return TorchMeta(
            slot_mapping=layout.slot_mapping.to(self.device),
            batched=batched,
            all_decode=not prefills and not short and len(batched) == 1,
            prefills=prefills,
        )

    def _few_tokens(self, layout: BatchLayout, group: list[tuple[int, int]]) -> bool:
        """Whether these sequences attend few enough context tokens for the native kernel to pay."""
        limit = self.native_max_context
        return limit is None or sum(layout.context_lens[i] + layout.query_lens[i] for i, _ in group) <= limit

    @staticmethod
    def _native(layout: BatchLayout, group: list[tuple[int, int]], prefills: list[_Prefill]) -> _Native:
        """group: (sequence index, its first row) of every sequence with a short query."""
        tables = [layout.block_tables[i][: (layout.context_lens[i] + layout.query_lens[i] + layout.block_size - 1)
                                         // layout.block_size] for i, _ in group]
        width = max(len(t) for t in tables)
        int32 = torch.int32
        return _Native(
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=int32),
            q_start=torch.tensor([first for _, first in group], dtype=int32),
            q_len=torch.tensor([layout.query_lens[i] for i, _ in group], dtype=int32),
            seq_len=torch.tensor([layout.context_lens[i] + layout.query_lens[i] for i, _ in group], dtype=int32),
            covers_all=not prefills,
        )

    def _batched(self, layout: BatchLayout, group: list[tuple[int, int]]) -> _Batched:
        """group: (sequence index, its first row). Pads every query to the longest and every context
        to the longest in blocks."""
        bs = layout.block_size
        q_lens = [layout.query_lens[i] for i, _ in group]
        ctxs = [layout.context_lens[i] for i, _ in group]
        q_len = max(q_lens)
        nblk = (max(c + q for c, q in zip(ctxs, q_lens)) + bs - 1) // bs
        flat: list[int] = []
        rows: list[int] = []
        for (i, first), q in zip(group, q_lens):
            bt = layout.block_tables[i][:nblk]
            flat += bt
            flat += [0] * (nblk - len(bt))
            rows += [first + min(j, q - 1) for j in range(q_len)]
        pos = torch.tensor(ctxs)[:, None] + torch.arange(q_len)[None, :]  # [B, q_len] query positions
        mask = torch.arange(nblk * bs)[None, None, :] <= pos[:, :, None]  # [B, q_len, L]
        keep = None
        if q_len > 1:
            keep = (torch.arange(q_len)[None, :] < torch.tensor(q_lens)[:, None]).flatten().nonzero()[:, 0]
            keep = keep.to(self.device)
        return _Batched(q_len, torch.tensor(rows, device=self.device), torch.tensor(flat, device=self.device),
                        mask[:, None, :, None, :].to(self.device), keep, pos.to(self.device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TorchMeta, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        num_blocks, block_size, hkv, d = k_cache.shape
        k_flat = k_cache.view(num_blocks * block_size, hkv, d)  # [S, Hkv, D]
        v_flat = v_cache.view(num_blocks * block_size, hkv, d)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        if meta.all_decode:
            return self._attend_batched(q, k_cache, v_cache, meta.batched[0], scale, True, window, softcap)
        out = q.new_empty(q.shape)
        if meta.native is not None:
            n = meta.native
            torch.ops.conveyor_cpu.paged_attention(
                out, q, k_cache, v_cache, n.block_tables, n.q_start, n.q_len, n.seq_len, scale,
                self.NATIVE_PART_TOKENS, window or 0, softcap or 0.0, self.native_isa)
            if n.covers_all:
                return out
        for b in meta.batched:
            o = self._attend_batched(q, k_cache, v_cache, b, scale, False, window, softcap)  # [B * q_len, H, D]
            if b.keep is None:
                out[b.rows] = o
            else:
                out[b.rows[b.keep]] = o[b.keep]
        gqa = q.shape[1] != hkv
        for p in meta.prefills:
            # 4-D [1, H, L, D]: 3-D inputs take SDPA's slow fallback on CPU (docs/performance.md).
            qp = q[p.token_slice].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            kp = k_flat.index_select(0, p.key_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vp = v_flat.index_select(0, p.key_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            mask = p.mask_for(window)
            op = attention(qp, kp, vp, mask, mask is None, scale, gqa, softcap)
            out[p.token_slice] = op[0].transpose(0, 1)
        return out

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V blocks [n, block_size, Hkv, D] each, copied into the reused workspace."""
        shape = (blocks.numel(), *k_cache.shape[1:])
        numel = math.prod(shape)
        if self._workspace.numel() < 2 * numel or self._workspace.dtype != k_cache.dtype:
            self._workspace = torch.empty(2 * numel, dtype=k_cache.dtype, device=k_cache.device)
        kb = torch.index_select(k_cache, 0, blocks, out=self._workspace[:numel].view(shape))
        vb = torch.index_select(v_cache, 0, blocks, out=self._workspace[numel:2 * numel].view(shape))
        return kb, vb

    def _attend_batched(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, b: _Batched, scale: float,
                        in_order: bool, window: int | None, softcap: float | None) -> torch.Tensor:
        """-> [B * q_len, H, D], row r answering query b.rows[r]. in_order: the rows are all of q."""
        _, _, hkv, d = k_cache.shape
        h = q.shape[1]
        g, n = h // hkv, b.q_len
        qb = q if in_order else q.index_select(0, b.rows)  # [B * n, H, D]
        bsz = qb.shape[0] // n
        # Query heads grouped by their KV head, queries and groups together in SDPA's query length.
        qb = qb.view(bsz, n, hkv, g, d).transpose(1, 2).reshape(bsz, hkv, n * g, d)  # [B, Hkv, n * G, D]
        qb = qb.to(k_cache.dtype)  # a bfloat16 cache under a float32 model: attend in the cache's dtype
        kb, vb = self._gather(k_cache, v_cache, b.blocks)
        kb = kb.view(bsz, -1, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        vb = vb.view(bsz, -1, hkv, d).transpose(1, 2)
        mask = b.mask_for(window)
        mask = mask.view(bsz, 1, 1, -1) if n == 1 else mask.expand(-1, -1, -1, g, -1).reshape(bsz, 1, n * g, -1)
        o = attention(qb, kb, vb, mask, False, scale, False, softcap)  # [B, Hkv, n * G, D]
        return o.view(bsz, hkv, n, g, d).transpose(1, 2).reshape(bsz * n, h, d).to(q.dtype)

    def copy_blocks(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv[:, :, dst] = kv[:, :, src]

    def swap_blocks(self, src_kv: torch.Tensor, dst_kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst_kv[:, :, dst.to(dst_kv.device)] = src_kv[:, :, src.to(src_kv.device)].to(dst_kv.device)
