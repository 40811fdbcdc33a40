"""Draft-model proposals: a smaller model with the target's vocabulary guesses k tokens, one
forward per token, batched over every speculating sequence.

The draft runs on its own KV cache with the target's block ids: the same number of blocks, so a
sequence's block table addresses both (the draft's blocks are smaller, having fewer layers and
heads). Nothing else tracks it. Each sequence counts the positions whose draft K/V is written
(draft_computed, kept by the scheduler); the first forward catches up from there to the last token
(a whole prompt the first time), then k - 1 one-token forwards extend the guess. After
verification the count falls back to what was accepted, and preemption resets it to 0 (swaps do
not carry draft K/V). Blocks
shared through the prefix cache may be written twice by two requests, with the same values.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from engine.batch import Batch
from engine.kv_cache import KVCache
from engine.load.weights import load_model
from engine.models import ModelConfig
from engine.sampler import argmax, exponential_, generator_of, probs_of
from engine.sequence import Sequence
from engine.step import Drafts
from kernels.backend import AttentionBackend
from shared.config import CacheConfig
from shared.model_source import resolve_model

log = logging.getLogger("conveyor.spec")


class DraftProposer:
    """Proposes inside the step, after scheduling: the scheduler reserves k drafts' worth of budget
    and blocks, and propose() fills them in before the target's forward."""

    def __init__(self, model_name: str, num_tokens: int, target: ModelConfig, num_blocks: int,
                 cache: CacheConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend) -> None:
        self.k = num_tokens
        self.greedy_only = False
        self.model, mc = load_model(resolve_model(model_name), dtype, device)
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {model_name!r} has a vocabulary of {mc.vocab_size} "
                             f"tokens; the target's has {target.vocab_size}: they must be the same")
        self.max_model_len: int | None = mc.max_position_embeddings
        self.kv = KVCache(dataclasses.replace(cache, num_blocks=num_blocks, num_cpu_blocks=0),
                          mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, device)
        self.block_size = cache.block_size
        self.device, self.backend = device, backend
        log.info("draft model %s: %d layers, %d proposals per step", model_name, mc.num_layers,
                 num_tokens)

    def plan(self, seq: Sequence, k: int) -> Drafts:
        return Drafts(k)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], drafts: list[Drafts]) -> list[Drafts]:
        nums = [d.num for d in drafts]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        batch = Batch(self.block_size)
        for s in seqs:
            batch.add(s.token_ids[s.draft_computed:], s.draft_computed, s.block_table, 1)
        active = list(range(len(seqs)))
        for step in range(max(nums)):
            if step:
                batch = Batch(self.block_size)
                active = [i for i in active if nums[i] > step]
                for i in active:
                    s = seqs[i]
                    batch.add(tokens[i][-1:], s.num_tokens + step - 1, s.block_table, 1)
            # [len(active), V]
            logits = batch.forward(self.model, self.kv.device, self.backend, self.device)
            self._sample(logits, [seqs[i] for i in active], [tokens[i] for i in active],
                         [probs[i] for i in active])
        # q per draft: [k, V]; None for greedy requests, whose drafts are the draft model's argmax
        return [Drafts(n, tuple(t), torch.stack(q) if q else None)
                for n, t, q in zip(nums, tokens, probs)]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                probs: list[list[torch.Tensor]]) -> None:
        """Greedy requests take the draft's argmax; the others sample from the draft's distribution
        under their own sampling parameters, keeping it as q for verification."""
        greedy = argmax(logits)
        rand = [i for i, s in enumerate(seqs) if not s.params.greedy]
        q = probs_of(logits[rand], [seqs[i] for i in rand]) if rand else None  # [R, V]
        for i, s in enumerate(seqs):
            if s.params.greedy:
                drafts[i].append(greedy[i])
        for j, i in enumerate(rand):
            assert q is not None
            position = seqs[i].num_tokens + len(drafts[i])
            generator = generator_of(seqs[i], position, q.device, stream=2)
            drafts[i].append(int((q[j] / exponential_(torch.empty_like(q[j]), generator)).argmax()))
            probs[i].append(q[j])
