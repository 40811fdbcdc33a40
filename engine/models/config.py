"""ModelConfig: an HF config.json normalised once, so models never getattr or guess defaults.

HF configs spell the same thing several ways across architectures and transformers versions
(rope_theta + rope_scaling before v5, rope_parameters since; eos_token_id as int or list; head_dim
present or implied). All of that is resolved here, and anything we cannot run exactly is refused
with a ValueError rather than served subtly wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF model_type -> architecture name, for configs saved without "architectures".
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# RoPE variants whose frequencies we compute (engine/models/llama.py:rope_inv_freq).
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "linear" | "llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2; Llama's attention_bias flag)
    o_proj_bias: bool  # bias on o_proj (only Llama's attention_bias flag sets it)
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: str = "float32"  # what the model was built in: engine/weights.py resolves --dtype auto

    @classmethod
    def from_hf(cls, d: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """d: a config.json dict. generation_config: generation_config.json, whose eos ids (e.g. Llama 3's
        <|eot_id|>) are added to the config's, because chat models end turns with them."""
        arch = _architecture(d)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if d.get("mlp_bias"):
            raise ValueError(f"{arch} with mlp_bias=True is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch} with hidden_act={d['hidden_act']!r} is not supported (only silu)")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        llama_bias = bool(d.get("attention_bias", False)) and not is_qwen2
        theta, scaling = _rope(d)
        max_pos = d.get("max_position_embeddings", 2048)
        # Sliding-window attention is not implemented: serve only lengths where it equals full attention.
        window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        if window:
            max_pos = min(max_pos, window)
        eos: list[int] = []
        for src in (d, generation_config or {}):
            for t in _ints(src.get("eos_token_id")):
                if t not in eos:
                    eos.append(t)
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            eos_token_ids=eos,
            bos_token_id=d.get("bos_token_id"),
        )


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        return str(archs[0])
    if d.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[d["model_type"]]
    raise ValueError(f"config.json names no architecture (architectures={archs}, model_type={d.get('model_type')!r})")


def _ints(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """-> (theta, scaling or None). Reads both the transformers v5 `rope_parameters` and the older
    `rope_theta` + `rope_scaling` spellings."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return theta, None
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in required[rope_type] if k not in params]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in the config")
    return theta, {"rope_type": rope_type, **{k: params[k] for k in required[rope_type]}}
