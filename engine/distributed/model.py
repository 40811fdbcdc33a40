"""One tensor-parallel rank's forward of the Llama family (engine/models/llama.py, split by shard.py).

The parameters are those of LlamaForCausalLM built with the rank's local config (1/N of the heads,
MLP units and vocabulary rows), so loading and the fused q/k/v, gate/up layout are unchanged. What
differs is the forward: two collectives per layer (after o_proj and after
down_proj, each the sum of the ranks' partial products), one after the embedding (each rank looks up
only its vocabulary rows) and one gather of the LM head's vocabulary columns to rank 0.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from engine.distributed.comm import Comm
from engine.distributed.shard import Shard
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.models.rope import Rotation, apply_rope, rotation
from kernels.backend import AttentionBackend


class ShardedLlama(LlamaForCausalLM):
    def __init__(self, shard: Shard) -> None:
        super().__init__(shard.local_config())
        self.shard = shard
        self.comm: Comm | None = None  # set by the owner once the process group exists

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, Hkv/N, D]
        attn_meta: object,
        backend: AttentionBackend,
        logits_rows: torch.Tensor,  # [B] int64
    ) -> torch.Tensor:  # [B, vocab] float32 on rank 0; [B, vocab/N] (unused) elsewhere
        comm, m = self.comm, self.model
        assert comm is not None
        # Vocabulary-parallel embedding: ids outside this rank's rows read row 0 and are zeroed.
        local = input_ids - self.shard.vocab_start  # [T]
        outside = (local < 0) | (local >= self.shard.vocab_per_rank)  # [T]
        h = F.embedding(local.masked_fill(outside, 0), m.embed_tokens.weight)  # [T, E]
        h = comm.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0.0))
        rope = rotation(self.rope, positions, native=False)
        for layer, kv in zip(m.layers, kv_cache):  # kv: [2, num_blocks, block_size, Hkv/N, D]
            h = layer_forward(cast(DecoderLayer, layer), comm, h, rope, kv[0], kv[1], attn_meta, backend)
        h = F.rms_norm(h[logits_rows], h.shape[-1:], m.norm.weight, m.norm.eps)  # [B, E]
        head = m.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V/N, E]
        logits = F.linear(h, head).float()  # [B, V/N]
        full = comm.gather_columns(logits)  # rank 0: [B, N * V/N]
        return logits if full is None else full[:, : self.shard.cfg.vocab_size]


def layer_forward(layer: DecoderLayer, comm: Comm, h: torch.Tensor, rope: Rotation, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, attn_meta: object, backend: AttentionBackend) -> torch.Tensor:
    """DecoderLayer.forward on this rank's heads and MLP units. h: [T, E], the same on every rank."""
    T, H, Hkv, D = h.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim  # local H, Hkv
    x = F.rms_norm(h, h.shape[-1:], layer.input_layernorm.weight, layer.input_layernorm.eps)  # [T, E]
    qkv = F.linear(x, layer.qkv_proj.weight, layer.qkv_proj.bias)  # [T, (H + 2Hkv) * D]
    qk = apply_rope(qkv[:, : layer.qk_size].view(T, H + Hkv, D), rope)  # [T, H + Hkv, D]
    q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D]
    v = qkv[:, layer.qk_size :].view(T, Hkv, D)  # [T, Hkv, D]
    o = backend.forward(q, k, v, k_cache, v_cache, attn_meta, layer.scale)  # [T, H, D]
    h = h + comm.all_reduce(o.reshape(T, H * D) @ layer.o_proj.weight.t())  # row-parallel o_proj: [T, E]
    if layer.o_proj.bias is not None:
        h += layer.o_proj.bias
    x = F.rms_norm(h, h.shape[-1:], layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    gate_up = F.linear(x, layer.gate_up_proj.weight)  # [T, 2I/N]
    act = F.silu(gate_up[:, : layer.inter]).mul_(gate_up[:, layer.inter :])  # [T, I/N]
    return h + comm.all_reduce(act @ layer.down_proj.weight.t())  # row-parallel down_proj: [T, E]
