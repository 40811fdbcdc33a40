"""Decoding algorithms as fork / append / free over shared blocks: parallel sampling (n, best_of) and
beam search. The scheduler calls in here only for requests that run several sequences.

Parallel sampling: the root sequence computes the prompt but for its last token, then forks into
best_of sequences that share every block (ref counts); each computes the last prompt token itself,
which writes into the shared partial block and so copies it first (copy-on-write), and then samples
on its own. With best_of == n each sequence streams; otherwise the n with the highest cumulative
logprob are sent at the end.

Beam search follows transformers' generate(num_beams=B, do_sample=False) step for step: every live
beam offers its 2B most likely next tokens; the 2B best accumulated scores are kept; of those, the
ones that stop (stop token, or length) and rank in the top B become finished hypotheses scored
sum_logprob / generated_len ** length_penalty, and the best B that do not stop continue. A parent
beam chosen k times forks k - 1 times; a parent chosen never is freed.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus, SequenceGroup

if TYPE_CHECKING:
    from engine.scheduler import Delta, Scheduler


def ready_to_fork(req: Request) -> bool:
    g = req.group
    return g is not None and not g.forked and req.num_computed_tokens == req.num_tokens - 1


def fork(root: Request, bm: BlockManager) -> list[Request]:
    """root -> root + (num_seqs - 1) new sequences over the same blocks. -> the new ones."""
    g = root.group
    assert g is not None and not g.forked
    g.forked = True
    children = [root.fork(i) for i in range(1, root.params.num_seqs)]
    for child in children:
        bm.fork(root, child)
    g.seqs += children
    return children


def deltas_of(req: Request) -> list[Delta]:
    """After req (a sequence of a group) appended a token: what the client gets now."""
    from engine.scheduler import Delta

    g = req.group
    assert g is not None
    if req.status.finished:
        g.seqs.remove(req)
        g.finished.append(req)
        if g.done:  # the request's timestamps are the root's, whichever sequence ended last
            g.root.events["finished"] = time.time()
    if g.streams:
        new = req.token_ids[req.num_prompt_tokens + req.num_sent_tokens:]
        lps = req.logprobs[req.num_sent_tokens:] if req.logprobs is not None else None
        req.num_sent_tokens += len(new)
        return [Delta(g.root, new, req.index, req.status.finish_reason, g.done, lps)]
    if not g.done:
        return []
    best = sorted(g.finished, key=lambda r: -r.cumulative_logprob)[:g.root.params.n]
    return [Delta(g.root, r.output_token_ids, i, r.status.finish_reason, i == len(best) - 1, r.logprobs)
            for i, r in enumerate(best)]


def beam_step(cands: list[tuple[Request, tuple]], sched: Scheduler, max_model_len: int) -> list[Delta]:
    """One beam search step of a group, once every live beam has its candidates."""
    g = cands[0][0].group
    assert g is not None and g.beam is not None
    st, p, root = g.beam, g.root.params, g.root
    for req, entry in cands:
        st.pending[id(req)] = (req, entry)
    if any(id(r) not in st.pending for r in g.seqs):
        return []  # a preempted beam has not computed this step yet
    root.events.setdefault("first_token", time.time())
    B = p.beam_width
    scored = [(req.cumulative_logprob + lp, req, tok) for req, entry in st.pending.values() for tok, lp in entry[1]]
    scored.sort(key=lambda c: -c[0])
    top = scored[:2 * B]
    st.pending = {}
    gen_len = g.seqs[0].num_output_tokens + 1  # generated tokens including the new one

    def stops(req: Request, tok: int) -> str | None:
        if tok in req.stop_ids and gen_len > p.min_tokens:
            return "stop"
        return "length" if gen_len >= p.max_tokens or req.num_tokens + 1 >= max_model_len else None

    reasons = [stops(req, tok) for _, req, tok in top]
    if st.improvable and not (len(st.finished) == B and p.early_stopping is True):
        for rank, ((score, req, tok), why) in enumerate(zip(top, reasons)):
            if rank < B and why:
                st.finished.append((score / gen_len ** p.length_penalty, req.output_token_ids + [tok], why))
        st.finished.sort(key=lambda f: -f[0])
        del st.finished[B:]
    running = [c for c, why in zip(top, reasons) if why is None][:B]
    if running and st.improvable and len(st.finished) == B:
        best_len = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else gen_len
        st.improvable = running[0][0] / best_len ** p.length_penalty > st.finished[-1][0]
    done = (not running or not st.improvable or (len(st.finished) == B and p.early_stopping is True))
    if done:
        return _finish(g, sched)
    _advance(g, running, sched)
    return []


def _advance(g: SequenceGroup, running: list[tuple[float, Request, int]], sched: Scheduler) -> None:
    """Make the chosen continuations the live beams: fork parents chosen more than once, free the rest."""
    chosen: dict[int, list[tuple[float, int]]] = {}
    for score, req, tok in running:
        chosen.setdefault(id(req), []).append((score, tok))
    beams: list[Request] = []
    for req in g.seqs:
        picks = chosen.get(id(req))
        if not picks:
            sched.drop(req, RequestStatus.FINISHED_STOPPED)
            continue
        for score, tok in picks[1:]:  # fork before the parent appends its own token
            child = req.fork(g.beam.next_index)
            g.beam.next_index += 1
            sched.bm.fork(req, child)
            child.token_ids.append(tok)
            child.cumulative_logprob = score
            sched.running.append(child)
            beams.append(child)
        req.token_ids.append(picks[0][1])
        req.cumulative_logprob = picks[0][0]
        beams.append(req)
    g.seqs = beams


def _finish(g: SequenceGroup, sched: Scheduler) -> list[Delta]:
    from engine.scheduler import Delta

    for req in g.seqs:
        sched.drop(req, RequestStatus.FINISHED_STOPPED)
    g.seqs = []
    root = g.root
    root.events["finished"] = time.time()
    best = g.beam.finished[:root.params.n]
    return [Delta(root, ids, i, why, i == len(best) - 1) for i, (_, ids, why) in enumerate(best)]
