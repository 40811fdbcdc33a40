"""Prompt logprobs (scoring): the log-probability of each prompt token given the tokens before it,
its rank in the vocabulary, and the top-k alternatives at its position, as vLLM's `prompt_logprobs`.

Computed during prefill, chunk by chunk: the runner asks the model for the logits of the chunk's
rows whose next token is a prompt token not scored yet (a [rows, V] tensor for that chunk only,
never for the whole prompt), normalises them (log-softmax) and keeps only the entries asked for. The
scheduler appends them to the request's `PromptScores` (one writer), and each choice's first output
row carries them all.

Each position is scored once: a chunk computed again (preemption by recompute) asks for no rows
whose token is scored already, so chunking and preemption cannot change a number. A cached prefix
has no logits at all: a request that still has tokens to score does not start on the prefix cache
(`bypasses_cache`), as vLLM does; docs/api.md says what that costs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.request import PromptEntry, PromptScores

if TYPE_CHECKING:
    from engine.sequence import Sequence
    from engine.step import Delta, StepOutput, StepPlan

def _scores(seq: Sequence) -> PromptScores | None:
    return seq.request.prompt_scores


def bypasses_cache(seq: Sequence) -> bool:
    """seq still has prompt tokens to score, and a cached prefix would have no logits for them."""
    s = seq.request.prompt_scores
    return s is not None and len(s.entries) < seq.num_prompt_tokens - 1


def rows_to_score(seq: Sequence, n: int) -> range:
    """Positions among seq's next n tokens whose logits score a prompt token not scored yet:
    position p scores token p + 1, for p + 1 < num_prompt_tokens."""
    s = seq.request.prompt_scores
    if s is None:
        return range(0)
    start = max(seq.num_computed_tokens, len(s.entries))
    return range(start, min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1))


def plan_rows(plan: StepPlan) -> tuple[list[int], list[tuple[int, range]]]:
    """-> (rows of the step's flattened batch whose logits are wanted, [(plan index,
    positions)])."""
    rows: list[int] = []
    wanted: list[tuple[int, range]] = []
    offset = 0
    for i, (seq, n) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
        if seq.request.prompt_scores is not None:
            positions = rows_to_score(seq, n)
            if positions:
                first = offset + positions.start - seq.num_computed_tokens
                rows += range(first, first + len(positions))
                wanted.append((i, positions))
        offset += n
    return rows, wanted


def score(
    logits: torch.Tensor, plan: StepPlan, wanted: list[tuple[int, range]]
) -> dict[int, list[PromptEntry]]:
    """logits: [rows, V] float32, the rows plan_rows named, in order. -> plan index -> its
    entries. log_softmax(x)[t] = x[t] - logsumexp(x): only the [rows] normaliser is computed,
    and the ranks and the top k come from the logits themselves (same order), so no second
    [rows, V] tensor is written. A token's logprob and its value among the top k are one
    subtraction of the same floats: equal."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [rows, 1]: this chunk's rows only
    vocab = logits.shape[-1]
    out: dict[int, list[PromptEntry]] = {}
    row = 0
    for i, positions in wanted:
        seq = plan.seqs[i]
        scores = _scores(seq)
        assert scores is not None
        part, norm = (
            logits[row : row + len(positions)],
            lse[row : row + len(positions)],
        )  # [m, V], [m, 1]
        row += len(positions)
        targets = torch.tensor(
            seq.token_ids[positions.start + 1 : positions.stop + 1], device=part.device
        )
        picked = part.gather(1, targets[:, None])  # [m, 1]
        ranks: list[int] = ((part > picked).sum(dim=-1) + 1).tolist()
        k = min(scores.k, vocab)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k:
            vals, ids = part.topk(k, dim=-1)  # [m, k]
            top_vals, top_ids = (vals - norm).tolist(), ids.tolist()
        values: list[float] = (picked - norm)[:, 0].tolist()
        out[i] = [
            (values[j], ranks[j], list(zip(top_ids[j], top_vals[j])) if k else [])
            for j in range(len(positions))
        ]
    return out


def record(plan: StepPlan, output: StepOutput) -> None:
    """The step's scores join their requests (each position once, in order)."""
    if not output.prompt_logprobs:
        return
    for i, entries in output.prompt_logprobs.items():
        scores = _scores(plan.seqs[i])
        assert scores is not None
        scores.entries += entries


def attach(deltas: list[Delta]) -> None:
    """A request's prompt logprobs ride on each choice's first output row (every prompt token
    is scored by then: a token is sampled only once the whole prompt is computed). Each
    choice's, so that a client that echoes the prompt in every choice (n > 1) has them
    whichever row it reads first."""
    for d in deltas:
        s = d.request.prompt_scores
        if s is not None and d.index not in s.sent and d.error is None:
            d.prompt_logprobs = s.entries
            s.sent.add(d.index)


# One prompt token on the wire: [logprob, rank, [[id, logprob], ...]].
WireRow = list[float | list[list[float]]]


def to_wire(entries: list[PromptEntry] | None) -> list[WireRow | None] | None:
    """-> JSON-ready [None, [logprob, rank, [[id, logprob], ...]], ...]: one per prompt token, the
    first None (nothing precedes it), as vLLM's prompt_logprobs."""
    if entries is None:
        return None
    wire: list[WireRow | None] = [None]
    wire.extend([lp, rank, [[t, v] for t, v in top]] for lp, rank, top in entries)
    return wire
