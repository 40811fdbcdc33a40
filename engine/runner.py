"""ModelRunner: turns a StepPlan into one varlen forward pass, then one sampling call (and, for
speculating sequences, one verification call)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.batch import Batch
from engine.kv_cache import KVCache
from engine.request import Request
from engine.sampler import LogprobEntry, Sampler
from engine.scheduler import StepPlan
from engine.spec.verify import verify
from kernels.backend import AttentionBackend

if TYPE_CHECKING:
    from engine.spec import Proposer


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend, device: torch.device,
                 proposer: Proposer | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = kv_cache.block_size
        self.device = device
        self.sampler = Sampler(device)
        self.proposer = proposer
        self.logprobs: list[LogprobEntry | None] | None = None  # per sampled token of the last step

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int]:
        """Compute every scheduled token; -> one token per request that reaches its end, in plan order.
        A speculating request computes its last token plus its drafts; its token is the one after the
        drafts it accepted (req.num_accepted)."""
        self._swap(plan)
        if plan.num_spec_requests and self.proposer is not None:
            self.proposer.propose([r for r in plan.requests if r.num_spec])
        batch = Batch(self.block_size)
        sampling: list[Request] = []
        for req, n in zip(plan.requests, plan.num_new_tokens):
            start = req.num_computed_tokens
            if req.num_spec:
                batch.add([req.token_ids[-1], *req.spec_token_ids], start, req.block_table, n)
                sampling.append(req)
            else:
                end = start + n
                last = end == req.num_tokens
                batch.add(req.token_ids[start:end], start, req.block_table, 1 if last else 0)
                if last:
                    sampling.append(req)
        logits = batch.forward(self.model, self.kv_cache.device, self.backend, self.device)  # [rows, V]
        if not sampling:
            self.logprobs = None
            return []
        if not plan.num_spec_requests:
            tokens = self.sampler(logits, sampling)
            self.logprobs = self.sampler.logprobs
            return tokens
        return self._sample_and_verify(logits, sampling)

    def _sample_and_verify(self, logits: torch.Tensor, sampling: list[Request]) -> list[int]:
        """Rows of plain requests go to the sampler, rows of speculating ones to verification."""
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        row = 0
        for req in sampling:
            n = req.num_spec + 1 if req.num_spec else 1
            (spec_rows if req.num_spec else plain_rows).extend(range(row, row + n))
            row += n
        plain = [r for r in sampling if not r.num_spec]
        spec = [r for r in sampling if r.num_spec]
        plain_tokens = iter(self.sampler(logits[plain_rows], plain) if plain else [])
        plain_lps = iter(self.sampler.logprobs or [None] * len(plain) if plain else [])
        spec_tokens = iter(verify(logits[spec_rows], spec))
        tokens, self.logprobs = [], []
        for req in sampling:
            tokens.append(next(spec_tokens) if req.num_spec else next(plain_tokens))
            self.logprobs.append(None if req.num_spec else next(plain_lps))
        if all(lp is None for lp in self.logprobs):
            self.logprobs = None
        return tokens

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
