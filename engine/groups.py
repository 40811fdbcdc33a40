"""Decoding algorithms as fork / append / free over shared blocks: parallel sampling (n, best_of)
and beam search. The scheduler calls in here only for requests that run several sequences, and
applies what comes back: these functions decide, they never touch a queue, a block or a sequence's
tokens. They keep the group's own record (which sequences are live, finished, the beam state).

Parallel sampling: the root sequence computes the prompt but for its last token, then forks into
best_of sequences that share every block (ref counts); each computes the last prompt token itself,
which writes into the shared partial block and so copies it first (copy-on-write), and then samples
on its own. With best_of == n each sequence streams; otherwise the n with the highest cumulative
logprob are sent at the end.

Beam search follows transformers' generate(num_beams=B, do_sample=False) step for step: every live
beam offers its 2B most likely next tokens; the 2B best accumulated scores are kept; of those, the
ones that stop (stop token, or length) and rank in the top B become finished hypotheses scored
sum_logprob / generated_len ** length_penalty, and the best B that do not stop continue. A parent
beam chosen k times forks k - 1 times; a parent chosen never ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.sequence import LogprobEntry, Sequence, SequenceGroup, stop_reason
from engine.step import Delta


def group_of(seq: Sequence) -> SequenceGroup:
    g = seq.group
    assert g is not None, "a group call on a single-sequence request"
    return g


def start(root: Sequence) -> None:
    group_of(root).seqs.append(root)


def unit_of(seq: Sequence) -> list[Sequence]:
    """seq and the sequences that move with it: every live beam of its request. Beams step together,
    so one preempted alone would hold its siblings (and their blocks) until it came back."""
    g = seq.group
    return list(g.seqs) if g is not None and g.beam is not None else [seq]


def holds_last_prompt_token(seq: Sequence) -> bool:
    """A request about to fork stops one short of its prompt: each of its sequences computes the
    last prompt token itself (and so has its own logits to sample from)."""
    g = seq.group
    return g is not None and not g.forked


def end(seq: Sequence) -> list[Sequence]:
    """seq's request ends: -> every sequence of it still live (seq alone without a
    group), none live after."""
    g = seq.group
    if g is None:
        return [seq]
    live, g.seqs = g.seqs, []
    return live


def fork_if_ready(root: Sequence) -> list[tuple[Sequence, Sequence]]:
    """Once root of a group that has not forked has computed its prompt but for the last token: ->
    (root, child) for the num_seqs - 1 new sequences it forks into, for the caller to share root's
    blocks with (as with a beam step's forks); nothing before."""
    g = root.group
    if g is None or g.forked or root.num_computed_tokens != root.num_tokens - 1:
        return []
    g.forked = True
    children = [root.fork(i) for i in range(1, root.params.num_seqs)]
    g.seqs += children
    return [(root, child) for child in children]


def settle(seq: Sequence) -> tuple[bool, list[Delta] | None]:
    """seq of a group appended a token or was stopped; a finished one leaves the live sequences. ->
    (whether the request is done now, what the client gets: None for seq's own new tokens when the
    group streams, else its n best sequences once it is done, nothing before)."""
    g = group_of(seq)
    if seq.status.finished:
        g.seqs.remove(seq)
        g.finished.append(seq)
    if g.streams:
        return g.done, None
    return g.done, _best_of(seq) if g.done else []


def _best_of(seq: Sequence) -> list[Delta]:
    """seq's group (not streaming) is done: its n best sequences by cumulative logprob, whole."""
    g, request = group_of(seq), seq.request
    best = sorted(g.finished, key=lambda s: -s.cumulative_logprob)[:request.params.n]
    return [Delta(request, s.output_token_ids, i, s.status.finish_reason, i == len(best) - 1,
                  s.logprobs) for i, s in enumerate(best)]


@dataclass
class BeamStep:
    """What one beam search step decided, for the scheduler to apply in this order."""

    request: Request
    # (parent, new beam sharing its blocks)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    # (beam, token, its new score)
    appends: list[tuple[Sequence, int, float]] = field(default_factory=list)
    ended: list[Sequence] = field(default_factory=list)  # beams that stop here
    # the request's outputs, when the search is over
    deltas: list[Delta] = field(default_factory=list)


def beam_step(cands: list[tuple[Sequence, LogprobEntry]], max_model_len: int) -> BeamStep | None:
    """One beam search step of a group once every live beam has its candidates; None until then."""
    request = cands[0][0].request
    g = group_of(cands[0][0])
    st, p = g.beam, request.params
    assert st is not None
    for seq, entry in cands:
        st.pending[id(seq)] = (seq, entry[1])
    if any(id(s) not in st.pending for s in g.seqs):
        return None  # a preempted beam has not computed this step yet
    B = p.beam_width
    scored = [(seq.cumulative_logprob + lp, seq, tok) for seq, top in st.pending.values()
              for tok, lp in top]
    scored.sort(key=lambda c: -c[0])
    top = scored[:2 * B]
    st.pending = {}
    gen_len = g.seqs[0].num_output_tokens + 1  # generated tokens including the new one
    reasons = [stop_reason(seq, tok, max_model_len) for _, seq, tok in top]
    if st.improvable and not (len(st.finished) == B and p.early_stopping is True):
        for rank, ((score, seq, tok), why) in enumerate(zip(top, reasons)):
            if rank < B and why:
                st.finished.append((score / gen_len ** p.length_penalty,
                                    seq.output_token_ids + [tok], why))
        st.finished.sort(key=lambda f: -f[0])
        del st.finished[B:]
    running = [c for c, why in zip(top, reasons) if why is None][:B]
    if running and st.improvable and len(st.finished) == B:
        best_len = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else gen_len
        st.improvable = running[0][0] / best_len ** p.length_penalty > st.finished[-1][0]
    if not running or not st.improvable or (len(st.finished) == B and p.early_stopping is True):
        ended, g.seqs = g.seqs, []
        best = st.finished[:p.n]
        deltas = [Delta(request, ids, i, why, i == len(best) - 1)
                  for i, (_, ids, why) in enumerate(best)]
        return BeamStep(request, ended=ended, deltas=deltas)
    return _advance(request, g, running)


def _advance(request: Request, g: SequenceGroup,
             running: list[tuple[float, Sequence, int]]) -> BeamStep:
    """The chosen continuations become the live beams: parents chosen more than once fork, the rest
    end."""
    assert g.beam is not None
    chosen: dict[int, list[tuple[float, int]]] = {}
    for score, seq, tok in running:
        chosen.setdefault(id(seq), []).append((score, tok))
    step = BeamStep(request)
    beams: list[Sequence] = []
    for seq in g.seqs:
        picks = chosen.get(id(seq))
        if not picks:
            step.ended.append(seq)
            continue
        for score, tok in picks[1:]:  # forked before the parent appends its own token
            child = seq.fork(g.beam.next_index)
            g.beam.next_index += 1
            step.forks.append((seq, child))
            step.appends.append((child, tok, score))
            beams.append(child)
        step.appends.append((seq, picks[0][1], picks[0][0]))
        beams.append(seq)
    g.seqs = beams
    return step
