"""The Llama family: Llama, Mistral, SmolLM2, and Qwen2 (= Llama with a q/k/v bias).

Input is one flattened varlen batch with no batch dim: every sequence's new tokens, concatenated
(T rows). Attention goes only through the backend, which also writes K/V into the paged cache.

Choices made for CPU speed, where one decode step reads every weight once and Python overhead
per layer is visible:
- q/k/v and gate/up are one GEMM each (fused when the weights are converted, see HF_NAMES).
- q and k rows are kept in the *interleaved* RoPE layout (dims 2i and 2i+1 rotate together, as in
  Meta's original checkpoints and in GGUF), so RoPE is a single complex multiply instead of HF's
  rotate_half (docs/performance.md). Scores q.k are unchanged because q and k are permuted
  alike; only the K stored in the KV cache is in that order. convert_hf_weights permutes HF rows.
- o_proj and down_proj add the residual inside the GEMM (addmm); the final norm and the LM head run
  only on the rows that sample (logits_rows), which is most of a short prompt's prefill cost.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from kernels.backend import AttentionBackend

# HF parameter name inside a decoder layer (without .weight/.bias) -> (ours, shard index in the fused
# tensor, or None when not fused). Shards are concatenated along dim 0 in index order.
HF_NAMES: dict[str, tuple[str, int | None]] = {
    "input_layernorm": ("input_layernorm", None),
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "self_attn.o_proj": ("o_proj", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
    "mlp.down_proj": ("down_proj", None),
}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """-> [D/2] float32 rotation frequencies, computed exactly as transformers does (same float ops)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    # llama3: keep high frequencies, divide low ones by factor, interpolate smoothly in between.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_table(cfg: ModelConfig) -> torch.Tensor:
    """-> [max_position_embeddings, D/2, 2] float32 (cos, sin), on the CPU even under a meta-device
    context, so a model built on meta has a real table."""
    pos = torch.arange(cfg.max_position_embeddings, device="cpu").float()
    angles = torch.outer(pos, rope_inv_freq(cfg))  # [P, D/2]
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [T, N, D] with interleaved pairs, rope: [T, 1, D/2] complex64 -> new [T, N, D] in x.dtype."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [T, N, D/2]
    return torch.view_as_real(xc * rope).flatten(-2).type_as(x)


def to_interleaved(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q/k rows from HF's half-split RoPE layout (dim j pairs with j + D/2) to interleaved pairs (2j, 2j+1).
    This is the permutation llama.cpp's converter applies; weights.py undoes it for GGUF files."""
    d_half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, d_half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qk_size = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
        self.inter = cfg.intermediate_size
        self.scale = cfg.head_dim**-0.5
        qkv_size = self.qk_size + cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self, h: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        attn_meta: object, backend: AttentionBackend,
    ) -> torch.Tensor:
        """h: [T, E] residual stream -> [T, E]. Calls F.* directly: module calls cost microseconds each."""
        T, H, Hkv, D = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = F.rms_norm(h, h.shape[-1:], self.input_layernorm.weight, self.input_layernorm.eps)  # [T, E]
        qkv = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)  # [T, (H + 2Hkv) * D]
        qk = apply_rope(qkv[:, : self.qk_size].view(T, H + Hkv, D), rope)  # [T, H + Hkv, D]
        # q, k, v are row-strided views (stride(1) == D, stride(2) == 1), not T-contiguous copies.
        q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D]
        v = qkv[:, self.qk_size :].view(T, Hkv, D)  # [T, Hkv, D]
        o = backend.forward(q, k, v, k_cache, v_cache, attn_meta, self.scale)  # [T, H, D]
        h = torch.addmm(h, o.reshape(T, H * D), self.o_proj.weight.t())  # h + o_proj(o): [T, E]
        if self.o_proj.bias is not None:
            h += self.o_proj.bias
        x = F.rms_norm(h, h.shape[-1:], self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        gate_up = F.linear(x, self.gate_up_proj.weight)  # [T, 2I]
        act = F.silu(gate_up[:, : self.inter]).mul_(gate_up[:, self.inter :])  # [T, I]
        return torch.addmm(h, act, self.down_proj.weight.t())  # h + down_proj(act): [T, E]


class LlamaModel(nn.Module):
    """Holds the parameters under HF's names (model.embed_tokens, model.layers.N, model.norm). They are
    not meaningfully initialised: the model is built on meta and engine/weights.py assigns real tensors."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # _weight skips the normal_() init, whose first call on meta costs ~1.5 s of lazy imports.
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        # Tied models have no lm_head parameter at all: forward uses the embedding, and loading stays strict.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: torch.Tensor  # [P, D/2, 2] float32, a buffer: moves with .to(), not saved
        self.register_buffer("rope", rope_table(cfg), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, all sequences' new tokens, concatenated
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, Hkv, D]
        attn_meta: object,  # backend.plan(layout), shared by all layers
        backend: AttentionBackend,
        logits_rows: torch.Tensor,  # [B] int64 rows of h whose next token is sampled
    ) -> torch.Tensor:  # [B, vocab] float32
        m = self.model
        h = F.embedding(input_ids, m.embed_tokens.weight)  # [T, E]
        rope = torch.view_as_complex(self.rope[positions]).unsqueeze(1)  # [T, 1, D/2] complex64
        for layer, kv in zip(m.layers, kv_cache):  # kv: [2, num_blocks, block_size, Hkv, D]
            h = layer(h, rope, kv[0], kv[1], attn_meta, backend)
        h = F.rms_norm(h[logits_rows], h.shape[-1:], m.norm.weight, m.norm.eps)  # [B, E]
        head = m.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, E]
        return F.linear(h, head).float()  # [B, V]

    def convert_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """HF-named tensors -> this model's state dict: fuse q/k/v and gate/up, permute q/k rows to the
        interleaved RoPE layout, drop a tied lm_head. Fuses each group as soon as it is complete, so
        peak memory stays near one model's worth when weights are streamed."""
        cfg = self.config
        heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
        out: dict[str, torch.Tensor] = {}
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            if not name.startswith("model.layers."):
                out[name] = t
                continue
            _, _, idx, rest = name.split(".", 3)  # model.layers.{idx}.{module}.{weight|bias}
            module, kind = rest.rsplit(".", 1)
            if module not in HF_NAMES:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            ours, shard = HF_NAMES[module]
            if module in heads:
                t = to_interleaved(t, heads[module])
            key = f"model.layers.{idx}.{ours}.{kind}"
            if shard is None:
                out[key] = t
                continue
            group = pending.setdefault(key, {})
            group[shard] = t
            if len(group) == (3 if ours == "qkv_proj" else 2):
                out[key] = torch.cat([group[i] for i in range(len(group))])
                del pending[key]
        if pending:
            raise ValueError(f"incomplete fused weights: {sorted(pending)}")
        return out
