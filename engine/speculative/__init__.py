"""Speculative decoding: a proposer guesses a sequence's next tokens; the model verifies them all in
one step (engine/speculative/verify.py), so a step can emit several tokens without changing the output.

Proposers have two calls: plan(seq, k) at schedule time, which decides how many drafts the step
verifies (and so how much budget and how many blocks it takes), and propose(seqs, drafts) just
before the forward, which fills in drafts that need a model. Both return Drafts, which the step's
plan carries; nothing is stored on the sequence. Prompt lookup does all its work in plan(); a
draft model does its work in propose().
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.models import ModelConfig
from engine.sequence import Sequence
from engine.speculative.draft import DraftProposer
from engine.speculative.ngram import NgramProposer
from engine.step import Drafts
from kernels.backend import AttentionBackend
from shared.config import CacheConfig, SpeculativeConfig
from shared.sampling import SamplingParams


class Proposer(Protocol):
    k: int  # drafts per sequence and step, at most
    max_model_len: int | None  # the longest sequence it can propose for (a draft model's context)

    def plan(self, seq: Sequence, k: int) -> Drafts:
        """How many drafts (at most k) seq verifies this step, with their tokens when known now."""
        ...

    def propose(self, seqs: list[Sequence], drafts: list[Drafts]) -> list[Drafts]:
        """The planned drafts of seqs with their tokens (and the proposer's probabilities) filled in."""
        ...


def can_speculate(params: SamplingParams) -> bool:
    """Requests whose next-token distribution depends only on the tokens before it. Penalties, logprobs,
    several sequences per request and structured output take the plain path (their outputs are the same
    either way)."""
    p = params
    # A constrained request opts out: verifying drafts under its mask would need the matcher rolled back
    # for every rejected draft (docs/structured_output.md).
    return (p.speculative and p.one_sequence and not p.has_penalties and p.logprobs is None
            and p.constraint is None)


def make_proposer(config: SpeculativeConfig, target: ModelConfig, num_blocks: int, cache: CacheConfig,
                  dtype: torch.dtype, device: torch.device, backend: AttentionBackend) -> Proposer | None:
    if config.method is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    assert config.draft_model is not None, "SpeculativeConfig names a draft model with method 'draft'"
    return DraftProposer(config.draft_model, config.num_speculative_tokens, target, num_blocks, cache, dtype,
                         device, backend)
