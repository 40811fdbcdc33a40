"""Speculative decoding: a proposer guesses a sequence's next tokens; the model verifies
them all in one step (engine/speculative/verify.py), so a step can emit several tokens
without changing the output.

Proposers have two calls: plan(seq, k) at schedule time, which decides how many drafts the step
verifies (and so how much budget and how many blocks it takes), and propose(seqs, drafts) just
before the forward, which fills in drafts that need a model. Both return Drafts, which the step's
plan carries; nothing is stored on the sequence. Prompt lookup does all its work in plan(); a
draft model does its work in propose().

`plan_drafts` gives drafts only to a decoding request that may speculate, and at most
`draft_limit` of them (fewer near max_tokens, max_model_len or the end of the step's budget: the
budget counts every verified token). Drafts never cause a preemption: when the blocks for them are
not free, the request decodes plainly. After verification the scheduler appends the accepted drafts
and the target's token, and `computed_after` says how much of the sequence's K/V still holds; the
rejected drafts' blocks go back to the pool.
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.block_manager import BlockManager
from engine.models import ModelConfig
from engine.sequence import Sequence
from engine.speculative.draft import DraftProposer
from engine.speculative.ngram import NgramProposer
from engine.speculative.window import DraftWindow
from engine.step import Drafts
from kernels.backend import AttentionBackend
from shared.config import CacheConfig, SpeculativeConfig
from shared.sampling import SamplingParams


class Proposer(Protocol):
    k: int  # drafts per sequence and step, at most
    greedy_only: bool  # sampled requests take the plain path (speculative="auto")
    max_model_len: int | None  # the longest sequence it can propose for (a draft model's context)

    def plan(self, seq: Sequence, k: int) -> Drafts:
        """How many drafts (at most k) seq verifies this step, with their tokens when known now."""
        ...

    def propose(self, seqs: list[Sequence], drafts: list[Drafts]) -> list[Drafts]:
        """The planned drafts of seqs with their tokens (and the proposer's
        probabilities) filled in."""
        ...


def can_speculate(params: SamplingParams, greedy_only: bool = False) -> bool:
    """Requests whose next-token distribution depends only on the tokens before it. Penalties,
    logprobs, several sequences per request and structured output take the plain path (their outputs
    are the same either way); so do sampled requests where the proposer is greedy_only (their
    verification samples every drafted position in Python: at 32 streams and temperature 1 on a CPU
    it cost more than their few accepted drafts saved, docs/performance.md)."""
    p = params
    if greedy_only and not p.greedy:
        return False
    # A constrained request opts out: verifying drafts under its mask would need the matcher rolled
    # back for every rejected draft (docs/structured_output.md); a thinking budget forces one token
    # a step.
    return (p.speculative and p.one_sequence and not p.has_penalties and p.logprobs is None
            and p.constraint is None and p.thinking_token_budget is None)


def plan_drafts(proposer: Proposer | None, unit: list[Sequence], ns: list[int], budget: int,
                max_model_len: int, bm: BlockManager) -> Drafts | None:
    """The drafts a unit the scheduler serves (ns[i] tokens for unit[i]) verifies this step: only a
    lone sequence that may speculate and decodes (its last token is the budget's first), within
    budget (what the step can spare: the scheduler leaves out what pending prompts could take),
    and none unless their blocks are free already: drafts never cause a preemption."""
    seq = unit[0]
    if proposer is None or len(unit) != 1 or not seq.request.speculate or ns[0] != 1:
        return None
    k = draft_limit(seq, proposer.k, budget - 1, max_model_len)
    if k:
        if seq.draft_window is None:
            seq.draft_window = DraftWindow(proposer.k)
        k = min(k, seq.draft_window.drafts_now())
    drafts = proposer.plan(seq, k) if k else None
    if (drafts is None or not drafts.num
            or not bm.can_allocate(bm.num_new_blocks(seq, seq.num_tokens + drafts.num))):
        return None
    return drafts


def draft_limit(seq: Sequence, k: int, budget: int, max_model_len: int) -> int:
    """How many drafts seq may verify this step: none unless it decodes (only its last
    token is left to compute), nor while min_tokens masks its stop ids (verification does not
    mask; with no stop ids, as under ignore_eos, min_tokens masks nothing); at most k and the
    budget, never past max_tokens or max_model_len."""
    p = seq.params
    if seq.num_computed_tokens != seq.num_tokens - 1 or (seq.num_output_tokens < p.min_tokens
                                                         and seq.stop_ids):
        return 0
    return max(0, min(k, budget, p.max_tokens - seq.num_output_tokens - 1,
                      max_model_len - seq.num_tokens - 1))


class SpecStats(dict[str, int]):
    """Speculative decoding's counters, as STATS reports them: verification steps (a request with
    drafts), drafts verified, drafts accepted."""

    def __init__(self) -> None:
        super().__init__(spec_verifications=0, spec_draft_tokens=0, spec_accepted_tokens=0)

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        self["spec_verifications"] += 1
        self["spec_draft_tokens"] += num_drafts
        self["spec_accepted_tokens"] += num_accepted

    def gauges(self) -> dict[str, float]:
        """The counters, the share of drafts accepted, and tokens per verification (accepted drafts
        + the one the target adds: 1.0 means speculation bought nothing)."""
        drafts, accepted = self["spec_draft_tokens"], self["spec_accepted_tokens"]
        steps = self["spec_verifications"]
        return {**{f"total_{k}": v for k, v in self.items()},
                "spec_acceptance_rate": accepted / drafts if drafts else 0.0,
                "spec_mean_accepted_length": 1 + accepted / steps if steps else 0.0}


def computed_after(computed_before: int, drafted: int, num_accepted: int,
                   num_tokens: int) -> tuple[int, int]:
    """A verified step computed the last token and the drafts; the accepted drafts and the target's
    token were appended since (up to a stop), to num_tokens. -> (the sequence's computed tokens: its
    last token and the accepted drafts, never the token just appended; the draft model's computed
    tokens, which it wrote up to `drafted` when it proposed)."""
    computed = min(computed_before + 1 + num_accepted, num_tokens - 1)
    return computed, min(drafted, computed)


def make_proposer(config: SpeculativeConfig, target: ModelConfig, num_blocks: int,
                  cache: CacheConfig, dtype: torch.dtype, device: torch.device,
                  backend: AttentionBackend) -> Proposer | None:
    if config.method is None or (config.method == "auto" and device.type != "cpu"):
        return None
    if config.method in ("auto", "ngram"):
        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max,
                             greedy_only=config.method == "auto")
    assert config.draft_model is not None, \
        "SpeculativeConfig names a draft model with method 'draft'"
    return DraftProposer(config.draft_model, config.num_speculative_tokens, target, num_blocks,
                         cache, dtype, device, backend)
