"""Model registry: HF architecture name (config.json "architectures") -> model class.

Every family is one graph with switches (engine/models/llama.py); ModelConfig.from_hf reads what
each family switches on. docs/models.md says how to add one.
"""
from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama with a sliding window on every layer
    "Qwen2ForCausalLM": LlamaForCausalLM,  # Llama with a q/k/v bias (ModelConfig.attention_bias)
    "Qwen3ForCausalLM": LlamaForCausalLM,  # per-head q/k RMSNorm (ModelConfig.qk_norm)
    # Qwen3 with mixture-of-experts MLPs (engine/models/moe.py)
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # fused weights in the checkpoint, LongRoPE
    # GeGLU, sandwich norms, soft-capping, alternating windows
    "Gemma2ForCausalLM": LlamaForCausalLM,
    # Gemma 2 without soft-capping, with q/k norms and local RoPE
    "Gemma3ForCausalLM": LlamaForCausalLM,
}

__all__ = ["MODELS", "ModelConfig", "get_model_class"]


def get_model_class(arch: str) -> type[LlamaForCausalLM]:
    try:
        return MODELS[arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch!r}; supported: "
                         f"{', '.join(sorted(MODELS))}") from None
