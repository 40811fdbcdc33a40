"""ModelRunner: turns a StepPlan into one varlen forward pass and one sampling call."""
from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import StepPlan
from kernels.backend import AttentionBackend, BatchLayout


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend, device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = kv_cache.block_size
        self.device = device
        self.sampler = Sampler(device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Compute every scheduled token; sample one token for each request that reaches its end."""
        self._swap(plan)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling: list[Request] = []
        context_lens: list[int] = []
        for req, n in zip(plan.requests, plan.num_new_tokens):
            start = req.num_computed_tokens
            end = start + n
            table = req.block_table
            input_ids.extend(req.token_ids[start:end])
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                span = range(start, end)
                positions.extend(span)
                slots.extend([table[p // bs] * bs + p % bs for p in span])
            context_lens.append(start)
            if end == req.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampling.append(req)
        layout = BatchLayout(
            query_lens=plan.num_new_tokens,
            context_lens=context_lens,
            block_tables=[r.block_table for r in plan.requests],
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
        )
        meta = self.backend.plan(layout)
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache.device,
            meta,
            self.backend,
            torch.tensor(logits_rows, dtype=torch.int64, device=self.device),
        )  # [B, V]
        if not sampling:
            return []
        return self.sampler(logits.float(), sampling)

    def _swap(self, plan: StepPlan) -> None:
        """Out before in: a block swapped out this step may be the very block another request swaps into."""
        kv = self.kv_cache
        for pairs, src, dst in ((plan.swap_out, kv.device, kv.cpu), (plan.swap_in, kv.cpu, kv.device)):
            if pairs:
                ids = torch.tensor(pairs, dtype=torch.int64)  # [N, 2] (src block, dst block)
                self.backend.swap_blocks(src, dst, ids[:, 0], ids[:, 1])
        if plan.copies:  # copy-on-write, after the swaps: a copy's source may just have been swapped in
            ids = torch.tensor(plan.copies, dtype=torch.int64)  # [N, 2] (shared block, its new copy)
            self.backend.copy_blocks(kv.device, ids[:, 0], ids[:, 1])
