"""Speculative decoding: a proposer guesses a sequence's next tokens; the model verifies them all in
one step (engine/spec/verify.py), so a step can emit several tokens without changing the output.

Proposers have two calls: plan(req, k) at schedule time, which decides how many drafts the step
verifies (and so how much budget and how many blocks it takes), and propose(reqs) just before the
forward, which fills in drafts that need a model. Prompt lookup does all its work in plan(); a
draft model does its work in propose().
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.models import ModelConfig
from engine.request import Request
from kernels.backend import AttentionBackend
from shared.config import CacheConfig, SpeculativeConfig


class Proposer(Protocol):
    k: int  # drafts per sequence and step, at most
    max_model_len: int | None  # the longest sequence it can propose for (a draft model's context)

    def plan(self, req: Request, k: int) -> int:
        """Set req.num_spec (and req.spec_token_ids when known now); -> the number of drafts."""
        ...

    def propose(self, reqs: list[Request]) -> None:
        """Fill req.spec_token_ids (num_spec of them) and req.spec_probs for the requests planned."""
        ...


def can_speculate(req: Request) -> bool:
    """Requests whose next-token distribution depends only on the tokens before it. Penalties, logprobs
    and several sequences per request take the plain path (their outputs are the same either way)."""
    p = req.params
    return (p.speculative and req.group is None and not p.has_penalties and p.logprobs is None)


def make_proposer(config: SpeculativeConfig, target: ModelConfig, num_blocks: int, cache: CacheConfig,
                  dtype: torch.dtype, device: torch.device, backend: AttentionBackend) -> Proposer | None:
    if config.method is None:
        return None
    if config.method == "ngram":
        from engine.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    from engine.spec.draft import DraftProposer

    return DraftProposer(config.draft_model, config.num_speculative_tokens, target, num_blocks, cache, dtype,
                         device, backend)
