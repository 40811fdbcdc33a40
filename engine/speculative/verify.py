"""Verification of proposed tokens: the target model scored the last token and k drafts in one
forward (k + 1 rows of logits); keep the longest prefix of drafts the target agrees with, then
one more token of the target's own. The output distribution is exactly the target's.

Greedy: accept while the draft equals the argmax; the token after is the argmax at the first
disagreement (or after the last draft). Sampled (Leviathan et al. 2023, Chen et al. 2023): accept
draft x with probability min(1, p(x) / q(x)), where p is the target's distribution (temperature,
top-k/p, min-p applied) and q the proposer's; at the first rejection sample from the residual
max(0, p - q), normalised; when every draft is accepted, sample the bonus token from p at the last
row. Prompt lookup proposes deterministically (q one-hot), where that rule is the same as sampling
each position and keeping drafts while they match the samples; done that way with the sampler's
own per-position noise, a seeded request's output is token for token what it is without
speculation. Seeded requests draw every random number from generators seeded by position
(engine/sampler.py: generator_of), so their output does not depend on the rest of the batch.
"""
from __future__ import annotations

import torch

from engine.sampler import argmax, exponential_, generator_of, probs_of
from engine.sequence import Sequence
from engine.step import Drafts


def verify(logits: torch.Tensor, seqs: list[Sequence],
           drafts: list[Drafts]) -> list[tuple[tuple[int, ...], int]]:
    """logits: [sum(num drafts + 1), V], each sequence's rows in order.
    -> per sequence, (the drafts it accepts, the token that follows them)."""
    rows: list[Sequence] = []
    starts = []
    for s, d in zip(seqs, drafts):
        starts.append(len(rows))
        rows += [s] * (d.num + 1)
    best = argmax(logits)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = probs_of(logits[sampled], [rows[i] for i in sampled]) if sampled else None  # [S, V]
    prow = {row: j for j, row in enumerate(sampled)}
    out = []
    for seq, d, start in zip(seqs, drafts, starts):
        ids = list(d.token_ids)
        if seq.params.greedy:
            a = _matching(ids, best[start:start + len(ids) + 1])
            token = best[start + a]
        else:
            assert probs is not None
            p = probs[prow[start]:prow[start] + len(ids) + 1]  # [k + 1, V]
            if d.probs is None:
                a, token = _sample_and_match(p, ids, None, seq)
            else:
                a, token = _rejection_sample(p, ids, d.probs, seq)
        out.append((d.token_ids[:a], token))
    return out


def _matching(drafts: list[int], targets: list[int]) -> int:
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def _sample_and_match(p: torch.Tensor, drafts: list[int], q: None,
                      seq: Sequence) -> tuple[int, int]:
    """Deterministic proposals (q one-hot): sample every position from p with the noise plain
    decoding would use there, keep the drafts while they equal the samples. P(accept x) = p(x), and
    after a mismatch the sample is p conditioned on not x, which is rejection sampling's residual:
    the same rule, and a seeded request gets exactly the tokens it gets without speculation."""
    noise = torch.empty_like(p)
    if seq.params.seed is None:
        exponential_(noise)
    else:
        for i in range(len(noise)):
            exponential_(noise[i], generator_of(seq, seq.num_tokens + i, p.device))
    samples = argmax(p / noise)
    a = _matching(drafts, samples)
    return a, samples[a]


def _rejection_sample(p: torch.Tensor, drafts: list[int], q: torch.Tensor,
                      seq: Sequence) -> tuple[int, int]:
    """p: [k + 1, V] target probabilities; q: [k, V] the draft's. -> (accepted drafts, next
    token)."""
    k, pos, dev = len(drafts), seq.num_tokens, p.device
    if seq.params.seed is None:
        u = torch.rand(k, device=dev, dtype=p.dtype).tolist()
    else:
        u = [float(torch.rand(1, generator=generator_of(seq, pos + i, dev, stream=1), device=dev))
             for i in range(k)]
    idx = torch.tensor(drafts, device=dev)
    p_x = p[:k].gather(1, idx[:, None])[:, 0].tolist()
    q_x = q.gather(1, idx[:, None])[:, 0].tolist()
    for i in range(k):
        if u[i] * q_x[i] < p_x[i]:  # u < p(x) / q(x), without dividing by a zero q(x)
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if not residual.sum() > 0:  # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        return i, _draw(residual, generator_of(seq, pos + i, dev))
    return k, _draw(p[k], generator_of(seq, pos + k, dev))


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token with probability proportional to weights (the exponential race, as the sampler)."""
    return int((weights / exponential_(torch.empty_like(weights), gen)).argmax())
