"""The thinking budget in the engine: a reasoning request's output reasons at most
`thinking_token_budget` tokens, then its end-of-reasoning ids are forced, one a step, and the model
goes on with its answer (Anthropic's thinking.budget_tokens, vLLM's thinking_token_budget).

- The state (shared/thinking.py: where the reasoning began, or that it ended) is
  `Sequence.thinking`, set at creation (engine/sequence.py), then written by the scheduler alone
  (`after`, with each token it appends); an int or None, so a fork copies it and preemption keeps it
  with the tokens.
- The sampler asks `force` for the rows whose budget is spent: their logits become -inf but for the
  forced id, after the raw log-softmax is taken, so a forced token's logprob is what the model gave
  it.
- The engine has no text, so a tag is matched by ids (shared/thinking.py): the end tag's own and
  the spellings in context the gateway found with its tokenizer (` </` after a space, `>.`); the
  forced end goes on with the spelling the output has begun.
- Budgeted requests do not speculate (engine/speculative can_speculate) and refuse beam search and
  grammars (shared/sampling.py): one token a step, each one this module has seen.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared import thinking

if TYPE_CHECKING:
    from engine.sequence import Sequence


def after(seq: Sequence) -> int | None:
    """seq's state once it has appended its last token (called for every token: None stays None)."""
    if seq.thinking is None:
        return None
    p = seq.params
    return thinking.after(seq.thinking, seq.token_ids, seq.num_prompt_tokens,
                          thinking.Tag(p.reasoning_start_ids), _end(seq))


def force(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The rows whose budget is spent allow only their next end id. -> logits, a copy when a row
    changed (the caller's logits stay as the model gave them: a failed batch is sampled again)."""
    forced = []
    for i, s in enumerate(seqs):
        budget = s.params.thinking_token_budget
        if s.thinking is not None and budget is not None:
            token = thinking.forced(s.thinking, s.token_ids, budget, _end(s))
            if token is not None:
                forced.append((i, token))
    if not forced:
        return logits
    logits = logits.clone()
    for i, token in forced:
        logits[i] = float("-inf")
        logits[i, token] = 0.0
    return logits


def _end(seq: Sequence) -> thinking.Tag:
    return thinking.Tag(seq.params.reasoning_end_ids, seq.params.reasoning_end_spellings)
