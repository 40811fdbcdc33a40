"""ModelConfig: an HF config.json normalised once, so models never getattr or guess defaults.

HF configs spell the same thing several ways across architectures and transformers versions
(rope_theta + rope_scaling before v5, rope_parameters since, per layer type for Gemma 3;
eos_token_id as int or list; head_dim present or implied; sliding windows as layer_types or as a
flag). All of that is resolved here, per family, and anything we cannot run exactly is refused with
a ValueError rather than served subtly wrong. What each family switches on is listed in
docs/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF model_type -> architecture name, for configs saved without "architectures".
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
}
# RoPE variants whose frequencies we compute (engine/models/rope.py).
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"),
              "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    # None, or {"rope_type": "linear" | "llama3" | "longrope", ...}
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2; Llama's attention_bias flag)
    o_proj_bias: bool  # bias on o_proj (only Llama's attention_bias flag sets it)
    eos_token_ids: list[int]
    bos_token_id: int | None
    # what the model was built in: engine/load/weights.py resolves --dtype auto
    dtype: str = "float32"
    # --- what the newer families switch on (defaults = the Llama family)
    hidden_act: str = "silu"  # silu | gelu_tanh (Gemma's GeGLU)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP as well
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    # None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_scale: float | None = None
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    # per layer: sliding window in tokens, None = global; () = all global
    layer_windows: tuple[int | None, ...] = ()
    # RoPE base of the sliding layers when it differs (Gemma 3)
    local_rope_theta: float | None = None
    num_experts: int = 0  # mixture of experts (Qwen3-MoE): experts per sparse layer, 0 = dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the mixture of experts
    # what the projections hold: none | int8 | int4 (engine/load/quant.py)
    quantization: str = "none"

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @classmethod
    def from_hf(cls, d: dict[str, Any],
                generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """d: a config.json dict. generation_config: generation_config.json, whose eos ids (e.g.
        Llama 3's <|eot_id|>) are added to the config's, because chat models end turns with them."""
        arch = _architecture(d)
        if arch not in _SUPPORTED:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(sorted(_SUPPORTED))}")
        if arch in _GEMMA:
            d = _gemma_legacy(arch, d)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if d.get("mlp_bias"):
            raise ValueError(f"{arch} with mlp_bias=True is not supported")
        act = d.get("hidden_activation") or d.get("hidden_act", "silu")
        if act not in _ACTS:
            raise ValueError(f"{arch} with activation {act!r} is not supported (only "
                             f"{', '.join(_ACTS)})")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        gemma = arch in _GEMMA
        llama_bias = bool(d.get("attention_bias", False)) and not is_qwen2
        d, local_theta = _local_rope(d)
        theta, scaling = _rope(d)
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        num_layers = d["num_hidden_layers"]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            # A base model has no head: the embedding stands in (it is served for embeddings).
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)) or _headless(d),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            eos_token_ids=_eos_ids(d, generation_config),
            bos_token_id=d.get("bos_token_id"),
            hidden_act=_ACTS[act],
            qk_norm=arch in _QK_NORM,
            sandwich_norms=gemma,
            embed_scale=float(d["hidden_size"]) ** 0.5 if gemma else None,
            attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
            attn_softcap=_float_or_none(d.get("attn_logit_softcapping")) if gemma else None,
            final_softcap=_float_or_none(d.get("final_logit_softcapping")) if gemma else None,
            layer_windows=_windows(arch, d, num_layers),
            local_rope_theta=local_theta,
            **_experts(arch, d, num_layers),
        )


# Each family's config reading is above; its graph is engine/models/llama.py (+ moe.py).
_SUPPORTED = tuple(_MODEL_TYPES.values())


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        arch = str(archs[0])
        return arch.removesuffix("Model") + "ForCausalLM" if _headless(d) else arch
    if d.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[d["model_type"]]
    raise ValueError(f"config.json names no architecture (architectures={archs}, "
                     f"model_type={d.get('model_type')!r}); supported: "
                     f"{', '.join(sorted(_SUPPORTED))}")


def _headless(d: dict[str, Any]) -> bool:
    """A base model's checkpoint (Qwen3Model: Qwen3-Embedding): the decoder without an LM head."""
    archs = d.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    return arch.endswith("Model") and arch.removesuffix("Model") + "ForCausalLM" in _SUPPORTED


def _windows(arch: str, d: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows, as transformers applies them: `layer_types` where the
    config has them (Qwen2/3, Gemma 2/3 since transformers v5), else every layer for Mistral
    and Phi-3 when sliding_window is set, and Qwen's use_sliding_window from
    max_window_layers up in older configs."""
    window = d.get("sliding_window")
    if not window:
        return ()
    types = d.get("layer_types")
    if types:
        if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types {types} not understood (expected sliding_attention / "
                             f"full_attention for each of {num_layers} layers)")
        wins = tuple(int(window) if t == "sliding_attention" else None for t in types)
    elif arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        wins = (int(window),) * num_layers
    elif d.get("use_sliding_window"):
        first = d.get("max_window_layers", 0)
        wins = tuple(int(window) if i >= first else None for i in range(num_layers))
    else:
        return ()
    return wins if any(w is not None for w in wins) else ()


def _local_rope(d: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """Gemma 3 has one RoPE per layer type: -> (d with the global one as its rope_parameters,
    for _rope; the sliding layers' base, or None where every layer rotates alike). Scaled
    sliding layers are refused."""
    rope = d.get("rope_parameters") or {}
    if "full_attention" not in rope:
        return d, None
    local = dict(rope.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError("RoPE scaling on sliding layers is not supported")
    return {**d, "rope_parameters": rope["full_attention"]}, float(local.get("rope_theta", 10000.0))


def _eos_ids(d: dict[str, Any], generation_config: dict[str, Any] | None) -> list[int]:
    """The config's eos ids, then generation_config's not among them (chat models end turns with
    those)."""
    eos: list[int] = []
    for src in (d, generation_config or {}):
        for t in _ints(src.get("eos_token_id")):
            if t not in eos:
                eos.append(t)
    return eos


def _experts(arch: str, d: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields (Qwen3-MoE): every decoder_sparse_step-th
    layer is sparse unless mlp_only_layers keeps it dense. Zero experts (every other
    family): a dense model."""
    num_experts = int(d.get("num_experts") or d.get("num_local_experts")
                      or 0) if arch == "Qwen3MoeForCausalLM" else 0
    step, dense_only = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or [])
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(d.get("num_experts_per_tok") or 0) if num_experts else 0,
        "moe_intermediate_size": int(d.get("moe_intermediate_size") or 0) if num_experts else 0,
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "sparse_layers": tuple(i for i in range(num_layers) if num_experts and (i + 1) % step == 0
                               and i not in dense_only),
    }


def _gemma_legacy(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma configs written before transformers had `layer_types` and per-layer-type RoPE (most
    Gemma 2 and 3 checkpoints on the hub) -> the current spelling, as transformers' config
    classes read them: a window on every layer but each `sliding_window_pattern`-th (2 for Gemma
    2, 6 for Gemma 3), and Gemma 3's sliding layers rotating with `rope_local_base_freq` (10000)
    without the global scaling."""
    d = dict(d)
    if d.get("sliding_window") and not d.get("layer_types"):
        period = int(d.get("sliding_window_pattern") or (2 if arch == "Gemma2ForCausalLM" else 6))
        d["layer_types"] = ["sliding_attention" if (i + 1) % period else "full_attention"
                            for i in range(d["num_hidden_layers"])]
    rope = d.get("rope_parameters") or {}
    if arch == "Gemma3ForCausalLM" and "full_attention" not in rope:
        full = dict(rope or d.get("rope_scaling") or {})
        full["rope_type"] = full.pop("type", full.get("rope_type", "default"))
        full.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        local = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq") or 10000.0}
        d["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return d


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


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
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope" and "original_max_position_embeddings" not in params:
        # Phi-3 keeps it at the top level of config.json
        params["original_max_position_embeddings"] = d.get("original_max_position_embeddings")
    missing = [k for k in _ROPE_KEYS[rope_type] if params.get(k) is None]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in the config")
    scaling = {"rope_type": rope_type, **{k: params[k] for k in _ROPE_KEYS[rope_type]}}
    if rope_type == "longrope":
        scaling["factor"] = params.get("factor")
        scaling["attention_factor"] = params.get("attention_factor")
    return theta, scaling
