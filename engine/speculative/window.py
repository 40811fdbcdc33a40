"""How many drafts a sequence proposes next, learned from how many of its last ones held.

A draft row costs a step nearly what a decoded row costs on a CPU (the attention, the head and the
GEMMs' rows grow with it; at 32 decodes a verified draft row was ~0.75 of a decoded one,
docs/performance.md), so a draft pays only where it is likely to be accepted. Prompt lookup's
guesses are bimodal: a sequence that copies its context, or repeats itself, accepts nearly all of
them; one that writes new text accepts nearly none. So each sequence keeps its own window: it grows
while every draft holds, shrinks to what held, and after drafts of which none held the sequence
decodes plainly for a pause that doubles with each such miss (at most MAX_PAUSE steps), then tries
one draft again. The window follows the sequence's own verifications (the traffic shows in it only
where a step's budget or free blocks cut its drafts), and drafting never changes the output
(engine/speculative/verify.py), only the steps it takes.
"""
from __future__ import annotations

MAX_PAUSE = 32  # decode steps without drafts after repeated misses, at most


class DraftWindow:
    __slots__ = ("k", "size", "pause", "misses")

    def __init__(self, k: int) -> None:
        self.k = k  # the proposer's most
        self.size = k  # drafts proposed at the next chance: optimistic, as a copy starts at once
        self.pause = 0  # decode steps left without drafts
        self.misses = 0  # verifications in a row that kept no draft

    def drafts_now(self) -> int:
        """Drafts this decode step may verify (0 during a pause, which this step counts down)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.size

    def verified(self, drafted: int, accepted: int) -> None:
        """A verification kept `accepted` of its `drafted` drafts."""
        if accepted == drafted:
            self.size, self.misses = min(self.k, 2 * drafted), 0
        elif accepted:
            self.size, self.misses = accepted, 0
        else:
            self.size, self.misses = 1, self.misses + 1
            self.pause = min(MAX_PAUSE, 2 ** self.misses)
