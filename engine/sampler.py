"""One batched sampling call per step.

Greedy rows take the argmax. Random rows are processed together (temperature, top-k, top-p,
min-p) and drawn by the exponential race argmax(p / E), E ~ Exp(1), which equals sampling from p.
A seeded row draws its E from its own generator, so its tokens do not depend on what else is in
the batch.
"""
from __future__ import annotations

import torch

from engine.request import Request


class Sampler:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """logits: [B, V] float32, one row per request that samples. -> B token ids."""
        self._suppress_early_stop(logits, reqs)
        if all(r.params.greedy for r in reqs):
            return logits.argmax(dim=-1).tolist()
        probs = self._probs(logits, reqs)  # [B, V]
        noise = torch.empty_like(probs)
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=self.device).manual_seed(r.params.seed)
                noise[i].exponential_(generator=r.generator)
            else:
                noise[i].exponential_()
        tokens = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor([r.params.greedy for r in reqs], device=logits.device)
        if greedy.any():
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        return tokens.tolist()

    @staticmethod
    def _suppress_early_stop(logits: torch.Tensor, reqs: list[Request]) -> None:
        """min_tokens: a request may not stop before it has produced that many tokens."""
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens and r.stop_ids:
                logits[i, list(r.stop_ids)] = float("-inf")

    @staticmethod
    def _probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature or 1.0 for r in reqs], dtype=logits.dtype, device=logits.device)
        logits = logits / temps[:, None]
        top_ks = [r.params.top_k for r in reqs]
        if any(k > 0 for k in top_ks):
            vocab = logits.shape[-1]
            ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])  # [B, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_ps = [r.params.top_p for r in reqs]
        if any(p < 1.0 for p in top_ps):
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            # Drop a token when the mass before it already reaches top_p (the top token always stays).
            before = sorted_p.cumsum(dim=-1) - sorted_p
            ps = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device)[:, None]
            sorted_p = sorted_p.masked_fill(before >= ps, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p)
        min_ps = [r.params.min_p for r in reqs]
        if any(p > 0 for p in min_ps):
            mp = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None]
            probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs
