"""HF-named checkpoint tensors -> the state dict of engine/models/llama.py, for every family.

What differs by family is only here: q/k/v and gate/up are fused (Phi-3 ships them fused already, so
its q and k parts are split out, permuted and fused again), q/k rows and per-head q/k norm weights
go to the interleaved RoPE layout, Gemma's norms scale by (1 + w) and are stored as that sum, and
Qwen3-MoE's per-expert matrices are stacked into one [E, ...] tensor per layer.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.models.config import ModelConfig
from engine.models.rope import to_interleaved

# HF parameter name inside a decoder layer (without .weight/.bias) -> (ours, shard index in the
# fused tensor, or None when not fused). Shards are concatenated along dim 0 in index order.
HF_NAMES: dict[str, tuple[str, int | None]] = {
    "input_layernorm": ("input_layernorm", None),
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "self_attn.qkv_proj": ("qkv_proj", None),  # Phi-3: fused in the checkpoint
    "self_attn.q_norm": ("q_norm", None),
    "self_attn.k_norm": ("k_norm", None),
    "self_attn.o_proj": ("o_proj", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm", None),
    "post_feedforward_layernorm": ("post_feedforward_layernorm", None),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
    "mlp.gate_up_proj": ("gate_up_proj", None),  # Phi-3: fused, gate rows first
    "mlp.down_proj": ("down_proj", None),
    "mlp.gate": ("moe.gate", None),  # the MoE router
    "mlp.experts.gate_up_proj": ("moe.gate_up", None),  # transformers v5's own fused expert tensors
    "mlp.experts.down_proj": ("moe.down", None),
}
_EXPERT_NAMES = {"gate_proj": ("moe.gate_up", 0), "up_proj": ("moe.gate_up", 1),
                 "down_proj": ("moe.down", 0)}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def convert_hf_weights(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                       partial: bool = False) -> dict[str, torch.Tensor]:
    """Fuses each group as soon as it is complete, so peak memory stays near one model's worth when
    weights are streamed. partial: drop incomplete fused groups instead of raising (per-matrix
    side data, such as quantization groups, that only some matrices have)."""
    return dict(iter_converted(cfg, weights, partial))


def iter_converted(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                   partial: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """convert_hf_weights one tensor at a time: each is yielded as soon as it is complete (a
    fused one when its last part arrives), and this generator holds no reference to it, nor to
    its parts, once the caller asks for the next, so a caller that consumes each (quantizes
    it) keeps only that one."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    gemma = cfg.architecture in _GEMMA
    for name, t in weights:
        if not name.startswith(("model.", "lm_head.")):  # a base model's (Qwen3Model) has no prefix
            name = f"model.{name}"
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight"
                                                    and cfg.tie_word_embeddings):
            continue
        if gemma and name.endswith("norm.weight"):
            t = t + 1  # Gemma's RMSNorm multiplies by (1 + w)
        if not name.startswith("model.layers."):
            yield name, t
            del t
            continue
        _, _, idx, rest = name.split(".", 3)  # model.layers.{idx}.{module}.{weight|bias}
        # mlp.experts.{e}.{proj}.weight
        if rest.startswith("mlp.experts.") and rest.count(".") == 4:
            _, _, e, proj, _ = rest.split(".")
            stacked, part = _EXPERT_NAMES[proj]
            key = f"model.layers.{idx}.{stacked}"
            pending.setdefault(key, {})[int(e) * 2 + part] = t
            del t
            if len(pending[key]) == cfg.num_experts * (2 if stacked == "moe.gate_up" else 1):
                out = _stack_experts(pending.pop(key), cfg.num_experts, stacked == "moe.gate_up")
                yield key, out
                del out
            continue
        module, kind = rest.rsplit(".", 1) if rest.endswith((".weight", ".bias")) else (rest, "")
        if module not in HF_NAMES:
            raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
        ours, shard = HF_NAMES[module]
        t = _to_interleaved(cfg, module, t)
        key = f"model.layers.{idx}.{ours}" + (f".{kind}" if kind else "")
        if shard is None:
            yield key, t
            del t
            continue
        pending.setdefault(key, {})[shard] = t
        del t
        if len(pending[key]) == (3 if ours == "qkv_proj" else 2):
            out = _cat_shards(pending.pop(key))
            yield key, out
            del out
    if pending and not partial:
        raise ValueError(f"incomplete fused weights: {sorted(pending)}")


def _cat_shards(group: dict[int, torch.Tensor]) -> torch.Tensor:
    """The shards in index order along dim 0 (the dict, the caller's last reference to them, dies
    here)."""
    return torch.cat([group[i] for i in range(len(group))])


def _to_interleaved(cfg: ModelConfig, module: str, t: torch.Tensor) -> torch.Tensor:
    """q/k rows (and the per-head norms' weights) to the interleaved RoPE layout; others
    unchanged."""
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if module == "self_attn.q_proj":
        return to_interleaved(t, h)
    if module == "self_attn.k_proj":
        return to_interleaved(t, hkv)
    if module in ("self_attn.q_norm", "self_attn.k_norm"):
        return to_interleaved(t, 1)
    if module == "self_attn.qkv_proj":
        q, k, v = t.split((h * d, hkv * d, hkv * d))
        return torch.cat((to_interleaved(q, h), to_interleaved(k, hkv), v))
    return t


def _stack_experts(group: dict[int, torch.Tensor], num_experts: int, gate_up: bool) -> torch.Tensor:
    """-> [E, 2I, hidden] ([gate; up] rows per expert) or [E, hidden, I]."""
    if gate_up:
        return torch.stack([torch.cat((group[2 * e], group[2 * e + 1]))
                            for e in range(num_experts)])
    return torch.stack([group[2 * e] for e in range(num_experts)])
