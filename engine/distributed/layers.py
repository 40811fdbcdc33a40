"""What tensor parallelism adds to the one model graph (engine/models/llama.py): a row-parallel
projection whose forward all-reduces, and the vocabulary split in the embedding and LM-head hooks.

A rank's model is LlamaForCausalLM built with its shard's config (shard.py: 1/N of the heads, K/V
heads, MLP units and vocabulary rows), so DecoderLayer.forward runs unchanged: q/k/v and gate/up are
column-parallel by construction (their weights hold this rank's output rows), attention runs on the
rank's heads against its K/V blocks, and every norm, soft cap, window, scale and quantized kernel is
the single-rank code's. Only o_proj and down_proj, whose products are partial sums over the ranks,
and the vocabulary, whose rows are split, need communication (as nano-vllm's RowParallelLinear and
VocabParallelEmbedding / ParallelLMHead, and mini-sglang's).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.comm import Comm
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, add_linear, linear

# each decoder layer's projections that take a slice of columns
ROW_PARALLEL = ("o_proj", "down_proj")


class RowParallel(nn.Module):
    """A projection of this rank's input columns (any module llama.py can call: nn.Linear,
    prepacked, quantized). Its product is this rank's part of the sum; forward all-reduces it, so
    every rank has the whole output. A bias is held by rank 0 only (shard.py gives the others
    zeros): added once."""

    def __init__(self, inner: nn.Module, comm: Comm) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, K/N] -> [T, E], the sum over the ranks."""
        return self.comm.all_reduce(linear(x, self.inner))

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h + x @ W.T over all ranks: rank 0 adds the residual inside its GEMM (as one engine
        does), the others contribute their product alone; one all-reduce sums them."""
        part = add_linear(h, x, self.inner) if self.comm.rank == 0 else linear(x, self.inner)
        return self.comm.all_reduce(part)


class ShardedLlama(LlamaForCausalLM):
    """One rank's model: the single-rank graph on its shard (cfg: the shard's config), with
    the two vocabulary hooks overridden. Rank r holds vocabulary rows r*Vs.. of Vs =
    ceil(V/N), the last padded."""

    def __init__(self, cfg: ModelConfig, comm: Comm, vocab_start: int, vocab_size: int) -> None:
        super().__init__(cfg)
        self.comm, self.vocab_start, self.vocab_size = comm, vocab_start, vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """-> [T, E]: each rank looks up the ids in its rows (others read row 0, then zeroed),
        scaled as one engine scales; the all-reduce sums one row and N-1 zeros, exactly."""
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.config.vocab_size)  # [T]
        h = super().embed(local.masked_fill(outside, 0))  # [T, E]
        return self.comm.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0.0))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, E] -> [B, V] float32 on rank 0 (every rank's columns gathered, the padding
        cut); this rank's [B, V/N] elsewhere, which nothing reads. Soft-capping is per logit,
        so each rank caps its own."""
        part = super().logits(h)  # [B, V/N]
        full = self.comm.gather_columns(part)  # rank 0: [B, N * V/N]
        return part if full is None else full[:, : self.vocab_size]

    def split_projections(self) -> None:
        """Wraps each layer's o_proj and down_proj, once loading, quantizing and prepacking have
        made them what one engine would run. The layers then run in Python: the one native call
        for all layers (engine/models/native_stack.py) has no all-reduce between them."""
        self.native_stack = None
        for layer in self.model.layers:
            for name in ROW_PARALLEL:
                if hasattr(layer, name):  # an MoE layer has no down_proj
                    setattr(layer, name, RowParallel(getattr(layer, name), self.comm))
