"""One batched sampling call per step.

Greedy rows take the argmax. Random rows are processed together (temperature, top-k, top-p,
min-p) and drawn by the exponential race argmax(p / E), E ~ Exp(1), which equals sampling from p.
A seeded row draws its E from a generator seeded by (seed, position), so its tokens do not depend
on what else is in the batch (nor on speculative decoding, see engine/speculative/verify.py).

Before that, rows that ask for it get min_tokens (stop ids masked), logit_bias and penalties, in
that order, in place on the logits, and last a spent thinking budget forces its end ids
(engine/thinking.py). Logprobs (and the candidates of beam search, and the cumulative logprob
best_of ranks by) are the raw model's log_softmax, taken before any of that, as OpenAI reports them;
but rows under a structured-output constraint are masked first, in place (disallowed tokens -inf),
so theirs are the log_softmax of the masked logits (docs/structured_output.md). A step where every
row is plain greedy pays one attribute check per row and an argmax.
"""
from __future__ import annotations

import torch

from engine import thinking
from engine.sequence import LogprobEntry, Sequence
from engine.structured import apply_masks

# Per sampled row, a LogprobEntry where the row's sequence wants logprobs (or belongs to a group),
# else None; None altogether when no row wanted any (the common case).
Logprobs = list[LogprobEntry | None] | None


class Sampler:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], Logprobs]:
        """logits: [B, V] float32, one row per sequence that samples.
        -> (B token ids, their logprobs)."""
        if all(s.request.plain for s in seqs):
            return argmax(logits), None
        # structured output: in place, before everything (logprobs included)
        apply_masks(logits, seqs)
        lp_rows = [i for i, s in enumerate(seqs) if s.logprobs is not None or s.group is not None]
        raw_logp = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None  # [L, V]
        logits = thinking.force(self._process(logits, seqs), seqs)
        tokens = self._sample(logits, seqs)
        if raw_logp is None:
            return tokens, None
        return tokens, self._gather_logprobs(raw_logp, lp_rows, seqs, tokens)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if all(r.params.greedy for r in seqs):
            return argmax(logits)
        probs = probs_of(logits, seqs)  # [B, V]
        noise = torch.empty_like(probs)
        for i, r in enumerate(seqs):
            exponential_(noise[i], generator_of(r, r.num_tokens, self.device))
        tokens = argmax(probs / noise)
        if any(r.params.greedy for r in seqs):
            best = argmax(logits)
            tokens = [b if r.params.greedy else t for r, t, b in zip(seqs, tokens, best)]
        return tokens

    @staticmethod
    def _process(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """min_tokens, logit_bias and penalties, only on the rows that ask for them. -> the
        processed logits: a copy when any row changes (the caller's logits stay as the model gave
        them, so a failed batch can be sampled again row by row), else logits itself."""
        # Copied only for a row that changes: min_tokens with nothing to stop on (ignore_eos, as
        # benchmarks ask for exact lengths) or already met changes nothing, and a [B, V] copy is a
        # pass over the logits.
        masked = [r.params.min_tokens and r.num_output_tokens < r.params.min_tokens
                  and bool(r.stop_ids) for r in seqs]
        if not any(masked) and not any(r.params.has_penalties for r in seqs):
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, r in enumerate(seqs):
            p = r.params
            if masked[i]:
                logits[i, list(r.stop_ids)] = float("-inf")  # may not stop before min_tokens
            if not p.has_penalties:
                continue
            row = logits[i]  # [V] view
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
                row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype,
                                                    device=row.device))
            if p.repetition_penalty != 1.0:  # over prompt and output, as transformers
                ids = torch.tensor(r.token_ids, device=row.device).unique()
                seen = row[ids]
                row[ids] = torch.where(seen < 0, seen * p.repetition_penalty,
                                       seen / p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.num_output_tokens:
                out = torch.tensor(r.token_ids[r.num_prompt_tokens:], device=row.device)
                counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)  # [V]
                present = (counts > 0).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * present
        return logits

    @staticmethod
    def _gather_logprobs(raw_logp: torch.Tensor, rows: list[int], seqs: list[Sequence],
                         tokens: list[int]) -> list[LogprobEntry | None]:
        ks = [_top_k_wanted(seqs[i]) for i in rows]
        k = max(ks)
        idx = torch.tensor([tokens[i] for i in rows], device=raw_logp.device)
        sampled: list[float] = raw_logp.gather(1, idx[:, None])[:, 0].tolist()  # [L]
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if k:
            vals, ids = raw_logp.topk(k, dim=-1)  # [L, k]
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out: list[LogprobEntry | None] = [None] * len(seqs)
        for j, i in enumerate(rows):
            kj = ks[j]
            out[i] = (sampled[j], list(zip(top_ids[j][:kj], top_vals[j][:kj])) if kj else [])
        return out


def argmax(logits: torch.Tensor) -> list[int]:
    """Row-wise argmax [B, V] -> B ids, the first of equal maxima (as torch's). On the CPU through
    numpy, whose vectorised argmax is several times faster than torch's at a full vocabulary:
    torch's was most of a small model's decode step (docs/performance.md)."""
    ids: list[int]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        ids = logits.contiguous().numpy().argmax(axis=-1).tolist()
    else:
        ids = logits.argmax(dim=-1).tolist()
    return ids


def _top_k_wanted(seq: Sequence) -> int:
    """Top logprobs a row reports: the request's own `logprobs`, or 2 * beam_width beam
    candidates under beam search."""
    p = seq.params
    k = p.logprobs or 0
    if p.use_beam_search:
        k = max(k, 2 * p.beam_width)
    return k


def probs_of(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, top-p and min-p.
    -> [B, V]"""
    temps = torch.tensor([r.params.temperature or 1.0 for r in seqs], dtype=logits.dtype,
                         device=logits.device)
    logits = logits / temps[:, None]
    top_ks = [r.params.top_k for r in seqs]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[-1]
        ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_ps = [r.params.top_p for r in seqs]
    if any(p < 1.0 for p in top_ps):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        before = sorted_p.cumsum(dim=-1) - sorted_p
        ps = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device)[:, None]
        sorted_p = sorted_p.masked_fill(before >= ps, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
    min_ps = [r.params.min_p for r in seqs]
    if any(p > 0 for p in min_ps):
        # transformers' MinPLogitsWarper: drop tokens below min_p times the top token's probability.
        mp = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None]
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def exponential_(out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fills `out` with Exp(1) noise, the values `out.exponential_(generator=generator)` draws,
    about 3x faster on the CPU; -> out. torch's CPU kernel takes one float64 uniform u per element,
    in memory order, and keeps -log1p(-u) element by element; here the generator draws the same
    uniforms in one call, log1p runs vectorized, and the sign flips after the rounding to out's
    dtype (it commutes with it). tests/engine/test_sampler.py holds the two to the same bits;
    `python bench/step_profile.py --sampling` times them (a 32-row step of SmolLM2's 49,152-token
    vocabulary on the AMX Xeon: 24-25 against 8-9 ms)."""
    if out.device.type != "cpu":
        return out.exponential_(generator=generator)
    u = torch.empty(out.shape, dtype=torch.float64).uniform_(generator=generator)
    return out.copy_(torch.log1p(u.neg_(), out=u)).neg_()


def generator_of(seq: Sequence, position: int, device: torch.device,
                 stream: int = 0) -> torch.Generator | None:
    """The RNG for the token at `position` of a seeded request (None: the global one, unseeded).

    Seeded from (seed, sequence index, position, stream) afresh for each token, so a seeded token's
    randomness depends on nothing but where it is: not on the batch, not on preemption, and not on
    how many draws speculative decoding made before it. `stream` separates the draws of different
    purposes at one position (sampling, accepting a draft, the draft model's own sampling)."""
    seed = seq.params.seed
    if seed is None:
        return None
    key = hash((seed, seq.index, position, stream)) & (2**63 - 1)
    return torch.Generator(device=device).manual_seed(key)
