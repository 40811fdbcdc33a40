"""Model registry: HF architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # same graph; sliding window is capped in ModelConfig
    "Qwen2ForCausalLM": LlamaForCausalLM,  # Llama with a q/k/v bias (ModelConfig.attention_bias)
}

__all__ = ["MODELS", "ModelConfig", "get_model_class"]


def get_model_class(arch: str) -> type[LlamaForCausalLM]:
    try:
        return MODELS[arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(MODELS))}") from None
