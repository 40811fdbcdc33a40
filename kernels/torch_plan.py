"""The torch backend's plan of a step's attention calls, made once per step and read by every layer.

The native kernel (kernels/cpu) takes the decodes and short queries of a step in one call, and with
native prompts every row. Otherwise short queries go through batched SDPA calls: decode tokens
(query length 1) in one, and queries of 2..SHORT_QUERY tokens over a cached context (speculative
verification, the tail of a chunked prompt) in another, padded to the longest. Block tables become
one padded list of block ids per call, so each layer gathers whole blocks (contiguous block_size *
Hkv * D runs instead of one slot at a time) and makes one attention call instead of a Python loop
over sequences. Sequences whose contexts differ a lot go into separate calls (buckets by length),
since padding every context to the longest one gathers and attends blocks no query sees. Longer
prompt chunks are few per step and run one SDPA each, with a mask where a prefix is cached.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.backend import BatchLayout

# Queries up to this long over a cached context are batched (padded) instead of run one by one.
SHORT_QUERY = 16
# Padded blocks a separate attention call must save before a batch is split by context length: one
# more call per layer (gathers, SDPA, scatter) costs about as much as gathering and attending this
# many K/V blocks of SmolLM2-135M (bench: python bench/cpu_attention.py).
SPLIT_COST_BLOCKS = 16
# A new call starts at a context this much shorter than the current call's longest, so no sequence
# is padded by more than 1 / SPLIT_RATIO and the calls' lengths fall geometrically.
SPLIT_RATIO = 0.7
# At most this many calls per group and layer, however spread the contexts are.
MAX_BUCKETS = 8


@dataclass
class Prefill:
    token_slice: slice  # rows of this sequence's new tokens in the flattened batch
    key_slots: torch.Tensor  # [L] int64 slots of positions 0..L-1
    mask: torch.Tensor | None  # [q, L] (prefix_mask), None without cached context (plain causal)
    context: int = 0  # cached tokens before the first query
    # sliding window -> its [q, L] mask
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The causal mask, narrowed to the last `window` keys of each query (built once per step
        and window, then shared by every layer with that window)."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            q, L = self.token_slice.stop - self.token_slice.start, self.key_slots.numel()
            qpos = torch.arange(q)[:, None] + self.context  # [q, 1] positions of the queries
            key = torch.arange(L)[None, :]
            # transformers: visible iff q - window < key <= q
            hidden = (key > qpos) | (key <= qpos - window)
            self.windowed[window] = prefix_mask(hidden, self.key_slots.device)
        return self.windowed[window]


def prefix_mask(hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    """hidden [q, L] bool (True = masked) -> the mask SDPA takes on device. On the CPU an
    additive float mask (its flash kernel runs that faster than a bool one: docs/performance.md);
    elsewhere a bool mask, True = visible: CUDA's SDPA kernels want a float mask in the query's
    dtype and misread a float32 one under bfloat16 queries (bench/kernels.py measured a relative
    error of 0.9 before)."""
    if device.type == "cpu":
        return torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    return (~hidden).to(device)


@dataclass
class Batched:
    """B sequences with queries of at most q_len tokens, attended in one padded SDPA call."""

    q_len: int
    # [B * q_len] rows of the flattened batch; padding repeats a sequence's last row
    rows: torch.Tensor
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
class Native:
    """Sequences with short queries, for one call of the native kernel (int32, one entry per
    sequence)."""

    block_tables: torch.Tensor  # [S, max blocks], padded with block 0
    q_start: torch.Tensor  # [S] row of the sequence's first query in the flattened batch
    q_len: torch.Tensor  # [S]
    seq_len: torch.Tensor  # [S] context + query length
    covers_all: bool  # the sequences' rows are every row of the batch


@dataclass
class TorchMeta:
    slot_mapping: torch.Tensor  # [T]
    batched: list[Batched]
    all_decode: bool  # every row is a decode token, in order: one batched call covers the step
    prefills: list[Prefill]
    native: Native | None = None  # set instead of batched when the native kernel runs short queries


def slots_of(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..length-1 of a sequence. -> [length] int64"""
    blocks = torch.tensor(block_table[: (length + block_size - 1) // block_size], dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return slots[:length]


def buckets(num_blocks: list[int]) -> list[list[int]]:
    """Split sequences needing num_blocks[i] blocks into groups attended in one padded call each:
    walking from the longest, start a new group at a sequence SPLIT_RATIO times the group's longest
    or shorter, where padding it and the rest to that longest would waste at least
    SPLIT_COST_BLOCKS. -> groups of indices, each in ascending order."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__, reverse=True)
    groups, longest = [[order[0]]], num_blocks[order[0]]
    for pos in range(1, len(order)):
        i = order[pos]
        saved = (longest - num_blocks[i]) * (len(order) - pos)
        far = num_blocks[i] <= SPLIT_RATIO * longest and saved >= SPLIT_COST_BLOCKS
        if far and len(groups) < MAX_BUCKETS:
            groups.append([])
            longest = num_blocks[i]
        groups[-1].append(i)
    return [sorted(g) for g in groups]


def plan(layout: BatchLayout, device: torch.device, native: bool, native_prompts: bool,
         native_max_context: int | None) -> TorchMeta:
    """The step's attention calls, decided once per step and shared by every layer: the
    native kernel's sequences, the batched SDPA calls (by context-length bucket) and one call
    per long prompt chunk."""
    bs = layout.block_size
    decode, short, prefills, start = [], [], [], 0
    for i, (q, ctx) in enumerate(zip(layout.query_lens, layout.context_lens)):
        if q == 1:
            decode.append((i, start))
        elif (q <= SHORT_QUERY and ctx > 0) or (native and native_prompts):
            short.append((i, start))
        else:
            L = ctx + q
            mask = None
            if ctx > 0:  # query j sits at position ctx + j and sees keys 0..ctx + j
                hidden = torch.arange(L)[None, :] > (torch.arange(q)[:, None] + ctx)
                mask = prefix_mask(hidden, device)
            slots = slots_of(layout.block_tables[i], L, bs).to(device)
            prefills.append(Prefill(slice(start, start + q), slots, mask, ctx))
        start += q
    if native and (decode or short) and _few_tokens(layout, decode + short, native_max_context):
        calls = _native(layout, sorted(decode + short), prefills)
        return TorchMeta(slot_mapping=layout.slot_mapping.to(device), batched=[], all_decode=False,
                         prefills=prefills, native=calls)
    batched = []
    for group in (decode, short):
        if group:
            need = [(layout.context_lens[i] + layout.query_lens[i] + bs - 1) // bs
                    for i, _ in group]
            batched += [_batched(layout, [group[j] for j in b], device) for b in buckets(need)]
    return TorchMeta(
        slot_mapping=layout.slot_mapping.to(device),
        batched=batched,
        all_decode=not prefills and not short and len(batched) == 1,
        prefills=prefills,
    )


def _few_tokens(layout: BatchLayout, group: list[tuple[int, int]], limit: int | None) -> bool:
    """Whether these sequences attend few enough context tokens for the native kernel to pay."""
    return limit is None or sum(layout.context_lens[i] + layout.query_lens[i]
                                for i, _ in group) <= limit


def _native(layout: BatchLayout, group: list[tuple[int, int]], prefills: list[Prefill]) -> Native:
    """group: (sequence index, its first row) of every sequence with a short query."""
    bs = layout.block_size
    tables = [layout.block_tables[i][: (layout.context_lens[i] + layout.query_lens[i] + bs - 1)
                                     // bs] for i, _ in group]
    width = max(len(t) for t in tables)
    int32 = torch.int32
    return Native(
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=int32),
        q_start=torch.tensor([first for _, first in group], dtype=int32),
        q_len=torch.tensor([layout.query_lens[i] for i, _ in group], dtype=int32),
        seq_len=torch.tensor([layout.context_lens[i] + layout.query_lens[i] for i, _ in group],
                             dtype=int32),
        covers_all=not prefills,
    )


def _batched(layout: BatchLayout, group: list[tuple[int, int]], device: torch.device) -> Batched:
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
        real = torch.arange(q_len)[None, :] < torch.tensor(q_lens)[:, None]  # [B, q_len]
        keep = real.flatten().nonzero()[:, 0]
        keep = keep.to(device)
    return Batched(q_len, torch.tensor(rows, device=device), torch.tensor(flat, device=device),
                    mask[:, None, :, None, :].to(device), keep, pos.to(device))
