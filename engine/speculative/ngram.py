"""Prompt lookup (n-gram) proposals: no model, just the sequence's own tokens.

Edits, summaries, code and chat about a given text copy long runs of their context. If the last n
tokens occurred earlier, what followed them then is a good guess for what follows now. The search
runs over the token ids packed as 4-byte integers with bytes.rfind, so it is C speed even on long
contexts; a hit that is not 4-byte aligned straddles two tokens and is skipped.
"""
from __future__ import annotations

from array import array

from engine.sequence import Sequence
from engine.step import Drafts

_WIDTH = array("i").itemsize  # 4


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, trying the
    longest n first (n_max down to n_min). [] when nothing matches."""
    L = len(token_ids)
    if k <= 0 or n_min >= L:
        return []
    buf = array("i", token_ids).tobytes()
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = buf[(L - n) * _WIDTH:]
        end = (L - 1) * _WIDTH  # a match must end before the last token: something has to follow it
        while (pos := buf.rfind(suffix, 0, end)) >= 0:
            if pos % _WIDTH == 0:
                start = pos // _WIDTH + n
                return token_ids[start:start + k]
            end = pos + len(suffix) - 1  # misaligned: look further left
    return []


class NgramProposer:
    """Proposes at schedule time (it is cheap), so the step's budget counts exactly the drafts
    found."""

    def __init__(self, num_tokens: int, n_min: int, n_max: int, greedy_only: bool = False) -> None:
        self.k, self.n_min, self.n_max = num_tokens, n_min, n_max
        self.greedy_only = greedy_only
        self.max_model_len: int | None = None  # no model, no context limit of its own

    def plan(self, seq: Sequence, k: int) -> Drafts:
        found = propose_ngram(seq.token_ids, k, self.n_min, self.n_max)
        return Drafts(len(found), tuple(found))  # a deterministic guess: q is one-hot on it

    def propose(self, seqs: list[Sequence], drafts: list[Drafts]) -> list[Drafts]:
        """Nothing to do: plan() already proposed."""
        return drafts
