"""Resuming a request on a restarted engine: what the client keeps per request, and which requests
can be resumed exactly.

A request the engine lost is sent again as prompt + the tokens already delivered, with max_tokens
and min_tokens reduced by what was delivered, under the same request id (and without prompt_logprobs
once they were delivered: they ride on a request's first row). The engine then computes the very
next token the lost engine would have: greedy takes the argmax of the same context, and seeded
sampling draws from a generator seeded by (seed, choice index, absolute position) (engine/sampler.py
`generator_of`), which the resubmission leaves unchanged. The caller's stream, its detokenizer and
its stop-string state never notice; only `usage` needs the original prompt length, which the client
restores on every row of the resumed run.

What would change the output is refused (resume_refusal), and such a request ends with an error
instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shared import protocol as P
from shared.sampling import SamplingParams


def resume_refusal(params: SamplingParams) -> str | None:
    """Why a request with these params cannot be resumed exactly on a new engine; None when it can.

    - n > 1 or best_of > 1: several sequences forked from one prefill, ranked at the end by
      cumulative logprobs the client never sees;
    - beam search: the beams' scores and the candidates they were pruned from live in the engine
      only;
    - presence / frequency penalties: they count output tokens only, and resubmitted tokens would
      count as prompt (repetition_penalty counts prompt and output alike, so it resumes exactly);
    - structured output: the matcher's state lives in the engine."""
    if params.use_beam_search:
        return "beam search"
    if params.n > 1 or (params.best_of or 1) > 1:
        return f"n={params.n}, best_of={params.best_of}"
    if params.presence_penalty or params.frequency_penalty:
        return "presence/frequency penalties count the output tokens only"
    # resubmitted tokens would be prompt, and the grammar start afresh
    if params.constraint is not None:
        return "structured output: the grammar's state lives in the engine"
    return None


@dataclass(slots=True)
class InFlight:
    """What resubmitting one request takes: its original ADD and every token delivered for it so
    far. Written only through the client's RequestTable (shared/requests.py): its reader (note) and
    its resume (resubmit)."""

    add: P.Add
    refusal: str | None  # resume_refusal(add.params), computed once at add time
    delivered: list[int] = field(default_factory=list)
    # the first engine's prefix-cache hit, reported again in resumed rows
    num_cached_tokens: int = 0
    resumed: int = 0  # how many times it was resubmitted
    scored: bool = False  # its prompt logprobs were delivered (they ride on the first row)

    @classmethod
    def of(cls, add: P.Add) -> InFlight:
        try:
            refusal = resume_refusal(add.params)
        # a record sent without validation (for the engine to refuse): nothing to resume
        except TypeError:
            refusal = "its sampling parameters are not valid"
        return cls(add, refusal)

    def note(self, out: P.RequestOutput) -> None:
        """A row about to reach the caller: remember its tokens; on a resumed run, report the counts
        of the original request (the new engine sees the delivered tokens as prompt)."""
        if self.refusal is not None:
            return
        self.delivered += out.new_token_ids
        self.scored = self.scored or out.prompt_logprobs is not None
        if self.resumed:
            out.num_prompt_tokens = len(self.add.prompt_token_ids)
            out.num_cached_tokens = self.num_cached_tokens
            if out.finished:  # beside the engine's timestamps (those of the last run)
                out.events = {**(out.events or {}), "resumed": self.resumed}
        elif out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens

    def resubmit(self) -> P.Add | P.RequestOutput:
        """The ADD that continues this request on a new engine, or (nothing left to generate) the
        final row that ends it."""
        d = len(self.delivered)
        p = self.add.params
        if d >= p.max_tokens:
            return P.RequestOutput(self.add.request_id, [], True, "length",
                                   len(self.add.prompt_token_ids), self.num_cached_tokens)
        self.resumed += 1
        # Prompt logprobs delivered are not asked for again (nor sent twice); undelivered ones come
        # with the new engine's first row: then nothing was delivered and the prompt is the original
        # one.
        params = dataclasses.replace(p, max_tokens=p.max_tokens - d,
                                     min_tokens=max(0, p.min_tokens - d),
                                     prompt_logprobs=None if self.scored else p.prompt_logprobs)
        ids = [*self.add.prompt_token_ids, *self.delivered]
        return dataclasses.replace(self.add, prompt_token_ids=ids, params=params)  # pooling kept


def refusal_message(reason: str, refusal: str) -> str:
    return f"{reason}; this request cannot be resumed on a restarted engine ({refusal}): retry it"
