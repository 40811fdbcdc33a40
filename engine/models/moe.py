"""Mixture-of-experts MLP (Qwen3-MoE): a router picks the top k of E experts per token;
the experts run as two grouped GEMMs over all (token, expert) pairs sorted by expert,
never a Python loop per token.

torch._grouped_mm takes the rows sorted by group and each group's end offset, and multiplies each
group by its own expert's matrix in one call (on the CPU as well as CUDA), so a step costs the same
two GEMM launches whether one expert or all of them are hit. Where it is missing, the fallback loops
over the experts that received rows (at most E iterations, each one GEMM over all of that expert's
rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig

_GROUPED_MM = hasattr(torch, "_grouped_mm")


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k, self.norm_topk_prob, self.inter = cfg.num_experts_per_tok, cfg.norm_topk_prob, i
        self.gate = nn.Linear(hidden, e, bias=False)  # the router: [E, hidden]
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, hidden))  # per expert [gate; up] rows
        self.down = nn.Parameter(torch.empty(e, hidden, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, E_hidden] normed hidden states -> [T, E_hidden] the experts' weighted sum."""
        k = self.top_k
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = experts.flatten()  # [T * k] expert of each (token, slot) pair
        order = torch.argsort(flat, stable=True)  # pairs sorted by expert
        rows = order // k  # [T * k] the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0])  # [E]
        xs = x.index_select(0, rows)  # [T * k, hidden], grouped by expert
        gate_up = self._grouped(xs, self.gate_up, counts)  # [T * k, 2I]
        act = F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]  # [T * k, I]
        out = self._grouped(act, self.down, counts)  # [T * k, hidden]
        out = out * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, rows, out)  # sum each token's k expert outputs

    @staticmethod
    def _grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [N, in] rows grouped by expert (counts[e] rows for expert e), w: [E,
        out, in] -> [N, out]."""
        if _GROUPED_MM and x.dtype in (torch.float32, torch.bfloat16):
            offs = counts.cumsum(0).to(torch.int32)
            return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        out = x.new_empty(x.shape[0], w.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                out[start:start + n] = x[start:start + n] @ w[e].t()
                start += n
        return out
