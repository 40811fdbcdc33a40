"""Verification of proposed tokens: the target model scored the last token and k drafts in one
forward (k + 1 rows of logits); keep the longest prefix of drafts the target agrees with, then
one more token of the target's own. The output distribution is exactly the target's.

Greedy: accept while the draft equals the argmax; the token after is the argmax at the first
disagreement (or after the last draft). Sampled (Leviathan et al. 2023, Chen et al. 2023): accept
draft x with probability min(1, p(x) / q(x)), where p is the target's distribution (temperature,
top-k/p, min-p applied) and q the proposer's; at the first rejection sample from the residual
max(0, p - q), normalised; when every draft is accepted, sample the bonus token from p at the last
row. Prompt lookup proposes deterministically, so its q is one-hot: accept with probability p(x),
and the residual is p without x. A seeded request draws every random number from its own
generator, so its output does not depend on the rest of the batch.
"""
from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import generator_of, probs_of


def verify(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """logits: [sum(num_spec + 1), V], each request's rows in order. Sets req.num_accepted;
    -> the token that follows the accepted drafts, per request."""
    rows, starts = [], []
    for r in reqs:
        starts.append(len(rows))
        rows += [r] * (r.num_spec + 1)
    argmax = logits.argmax(dim=-1).tolist()
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    probs = probs_of(logits[sampled], [rows[i] for i in sampled]) if sampled else None  # [S, V]
    prow = {row: j for j, row in enumerate(sampled)}
    out = []
    for req, s in zip(reqs, starts):
        drafts = req.spec_token_ids
        if req.params.greedy:
            a = 0
            while a < len(drafts) and drafts[a] == argmax[s + a]:
                a += 1
            req.num_accepted = a
            out.append(argmax[s + a])
        else:
            p = probs[prow[s]:prow[s] + len(drafts) + 1]  # [k + 1, V]
            req.num_accepted, token = _rejection_sample(p, drafts, req.spec_probs, generator_of(req, p.device))
            out.append(token)
    return out


def _rejection_sample(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                      gen: torch.Generator | None) -> tuple[int, int]:
    """p: [k + 1, V] target probabilities; q: [k, V] proposal probabilities, None for one-hot.
    -> (accepted drafts, next token)."""
    k = len(drafts)
    u = torch.rand(k, generator=gen, device=p.device, dtype=p.dtype).tolist()
    idx = torch.tensor(drafts, device=p.device)
    p_x = p[:k].gather(1, idx[:, None])[:, 0].tolist()
    q_x = [1.0] * k if q is None else q.gather(1, idx[:, None])[:, 0].tolist()
    for i in range(k):
        if u[i] * q_x[i] < p_x[i]:  # u < p(x) / q(x), without dividing by a zero q(x)
            continue
        residual = (p[i] - q[i]).clamp_(min=0) if q is not None else p[i].clone().index_fill_(0, idx[i:i + 1], 0.0)
        if not residual.sum() > 0:  # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        return i, _draw(residual, gen)
    return k, _draw(p[k], gen)


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token with probability proportional to weights (the exponential race, as the sampler)."""
    noise = torch.empty_like(weights).exponential_(generator=gen)
    return int((weights / noise).argmax())
