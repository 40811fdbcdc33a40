"""The records one step passes along, each written once and read downstream:

    Scheduler.schedule() -> StepPlan -> ModelRunner.execute(plan) -> StepOutput
    Scheduler.update(plan, output) -> list[Delta] -> EngineCore -> RequestOutput on the wire

Nothing computed in a step travels on a shared object: the runner returns what it sampled and
the scheduler alone applies it to the sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.request import PromptEntry, Request
from engine.sequence import LogprobEntry, Sequence


class EngineFault(RuntimeError):
    """The step cannot run in this process any more, whatever the requests (a tensor-parallel worker
    died). Not a per-request failure: the loop ends every request with an error and exits, so that a
    supervisor starts a whole engine again."""


class BlockMoves(NamedTuple):
    """The block copies a step needs before its forward, in this order (BlockManager.take_moves)."""

    swap_out: list[tuple[int, int]]  # (device block, cpu block)
    swap_in: list[tuple[int, int]]  # (cpu block, device block)
    copies: list[tuple[int, int]]  # (device block, device block), copy-on-write


@dataclass(frozen=True, slots=True)
class Drafts:
    """Tokens a proposer guesses come next in one sequence, verified this step. probs: [k, V], the
    proposer's distribution per draft (None: a deterministic guess, one-hot on token_ids).
    A draft model decides at schedule time only how many (token_ids empty until it proposes)."""

    num: int
    token_ids: tuple[int, ...] = ()
    probs: torch.Tensor | None = None


@dataclass
class StepPlan:
    """What one step computes: seqs[i] computes its next num_new_tokens[i] tokens, after the runner
    has copied the swap_out, then the swap_in, then the copy-on-write block pairs. drafts[i]: the
    drafts seqs[i] verifies (its num_new_tokens[i] counts its last token plus the drafts).
    sampled[i]: seqs[i]'s entry in the StepOutput, or None when it samples nothing. A sequence
    samples when its tokens reach the end of its known tokens, or when it verifies drafts; a prompt
    chunk short of the end and an embedding's chunk do not. Decided here, once, at schedule time:
    the runner and Scheduler.update read it."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    drafts: dict[int, Drafts] = field(default_factory=dict)
    sampled: list[int | None] = field(default_factory=list)
    num_sampled: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device block, device block)
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, n: int, drafts: Drafts | None = None) -> None:
        reaches_end = drafts is not None or seq.num_computed_tokens + n >= seq.num_tokens
        samples = reaches_end and seq.request.pooling is None
        self.sampled.append(self.num_sampled if samples else None)
        self.num_sampled += samples
        if drafts is not None:
            self.drafts[len(self.seqs)] = drafts
            self.num_decode_tokens += n
        elif n == 1 and seq.num_prompt_tokens < len(seq.token_ids) == seq.num_computed_tokens + 1:
            self.num_decode_tokens += 1  # the next token of a sequence that has output already
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass(slots=True)
class StepOutput:
    """What the runner computed for a plan, in plan order, one entry per sequence that sampled
    (StepPlan.sampled names each sequence's entry). accepted[j]: the drafts sequence j kept before
    its token (None: no drafts this step). logprobs[j]: the sampled token's logprob entry where the
    sequence wants one (None: nobody did). errors[j]: why sequence j could not be sampled (its
    request fails; tokens[j] is meaningless). prompt_logprobs: plan index -> the prompt tokens that
    sequence's chunk scored (engine/prompt_logprobs.py)."""

    tokens: list[int] = field(default_factory=list)
    accepted: list[tuple[int, ...]] | None = None
    logprobs: list[LogprobEntry | None] | None = None
    errors: dict[int, str] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[PromptEntry]] | None = None
    # plan index -> an embedding chunk's part (engine/pooling.py)
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class Delta:
    """New tokens of one sequence (a request's choice `index`). finish_reason: this sequence's;
    finished: the whole request's (the last delta it sends). error: the request failed inside the
    engine (this is its last delta; the client gets an ERROR instead of outputs). prompt_logprobs:
    on the request's first delta, when it asked for them."""

    request: Request
    new_token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None
    finished: bool = False
    logprobs: list[LogprobEntry] | None = None
    error: str | None = None
    prompt_logprobs: list[PromptEntry] | None = None
    pooled: torch.Tensor | None = None  # an embedding's pooled total (engine/pooling.py finish)
