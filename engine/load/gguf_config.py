"""GGUF metadata -> an HF config.json dict: what llama.cpp's metadata keys mean, and what its
loaders assume for a family where the file is silent. The tensor half of reading a GGUF file (names,
the converter's permutations, dequantizing, the cached folder) is engine/load/gguf.py, which calls
this once per file; engine/models/config.py then reads the dict like any HF config.json.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# GGUF architecture -> (HF architecture, HF model_type). llama.cpp files Mistral under "llama"; its
# "mistral3" is Mistral 3 (YaRN, attention temperature), a family Conveyor does not serve.
_GGUF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
               "qwen3": ("Qwen3ForCausalLM", "qwen3"),
               "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
               "phi3": ("Phi3ForCausalLM", "phi3"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
               "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
GEMMA_ARCHS = ("gemma2", "gemma3")


def gguf_config(reader: Any) -> dict[str, Any]:
    """GGUF metadata -> an HF config.json dict ({arch}.* keys, tokenizer.ggml.* token ids), with
    what llama.cpp assumes for a family where the file is silent (Gemma's window patterns and local
    RoPE base, its attention scale, Qwen3-MoE's renormalised top-k)."""

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(_GGUF_ARCHS)}")
    hf_arch, model_type = _GGUF_ARCHS[arch]
    hidden, heads = get(f"{arch}.embedding_length"), get(f"{arch}.attention.head_count")
    head_dim = get(f"{arch}.attention.key_length") or hidden // heads
    by_name = {t.name: t for t in reader.tensors}
    rope = _rope(arch, get, by_name, head_dim)
    embd = by_name.get("token_embd.weight")
    vocab = int(embd.shape[-1]) if embd is not None else (
        get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data))
    # The ids that end generation: eos, plus end-of-turn / end-of-message where the file names them.
    eos = [get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    layers = get(f"{arch}.block_count")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get(f"{arch}.feed_forward_length")
        or get(f"{arch}.expert_feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": rope,
        "max_position_embeddings": get(f"{arch}.context_length"),
        "hidden_act": "silu",
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
    }
    if arch == "phi3":
        # 0: none (how the converter writes Phi-4)
        window = get(f"{arch}.attention.sliding_window", 0)
        config["sliding_window"] = window or None
    elif arch == "qwen3moe":
        gated = {int(n.split(".")[1]) for n in by_name if n.endswith(".ffn_gate_inp.weight")}
        # norm_topk_prob: llama.cpp's qwen3moe graph always renormalises the top-k weights
        config.update(num_experts=get(f"{arch}.expert_count"),
                      num_experts_per_tok=get(f"{arch}.expert_used_count"),
                      moe_intermediate_size=get(f"{arch}.expert_feed_forward_length"),
                      norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(layers) if i not in gated])
    elif arch in GEMMA_ARCHS:
        config.update(_gemma_config(arch, get, layers, hidden, heads, head_dim, rope))
    return config


def _rope(arch: str, get: Any, by_name: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The config's rope_parameters: the base, linear scaling from the metadata, or
    Phi-3's LongRoPE, which llama.cpp knows by its rope_factors_{long,short} tensors.
    Partial RoPE is refused."""
    rope_dims = get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"GGUF rope.dimension_count {rope_dims} != head_dim {head_dim}: partial "
                         "RoPE is not supported")
    rope_type = get(f"{arch}.rope.scaling.type", "none")
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": get(f"{arch}.rope.freq_base", 10000.0)}
    if rope_type == "linear":
        rope.update(rope_type="linear", factor=get(f"{arch}.rope.scaling.factor"))
    elif rope_type != "none":
        raise ValueError(f"GGUF rope scaling {rope_type!r} is not supported")
    if "rope_factors_long.weight" in by_name:
        if rope_type != "none":
            raise ValueError(f"GGUF LongRoPE factors together with rope scaling {rope_type!r} are "
                             "not supported")
        from gguf.quants import dequantize

        tensors = {k: by_name[f"rope_factors_{k}.weight"] for k in ("long", "short")}
        factors = {k: dequantize(t.data, t.tensor_type).astype(np.float64).tolist()
                   for k, t in tensors.items()}
        original = get(f"{arch}.rope.scaling.original_context_length")
        rope.update(rope_type="longrope", long_factor=factors["long"],
                    short_factor=factors["short"],
                    original_max_position_embeddings=original,
                    attention_factor=get(f"{arch}.rope.scaling.attn_factor"))
    return rope


def _gemma_config(arch: str, get: Any, layers: int, hidden: int, heads: int, head_dim: int,
                  rope: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's Gemma 2 / 3 loaders read or assume: a window on all but every 2nd (Gemma 2)
    / 6th (Gemma 3) layer unless the file gives attention.sliding_window_pattern (a period, or a
    flag per layer: true = sliding); Gemma 3's sliding layers rotate with base 10000 unless
    rope.freq_base_swa says otherwise, and without the global layers' scaling; q is scaled by
    1/sqrt(head_dim), except for the 27B models (46 / 62 layers), which use 1/sqrt(hidden / heads);
    Gemma 2's soft-caps default to 50 (scores) and 30 (logits) when the file omits them."""
    gemma2 = arch == "gemma2"
    window = get(f"{arch}.attention.sliding_window", 4096 if gemma2 else None)
    pattern = get(f"{arch}.attention.sliding_window_pattern", 2 if gemma2 else 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"GGUF sliding_window_pattern has {len(pattern)} entries for {layers} "
                             "layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [int(pattern) > 0 and i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    big = layers == (46 if gemma2 else 62)
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attn_logit_softcapping": get(f"{arch}.attn_logit_softcapping", 50.0) if gemma2 else None,
        "final_logit_softcapping": get(f"{arch}.final_logit_softcapping", 30.0 if gemma2 else None),
    }
    if not gemma2:
        local = {"rope_type": "default", "rope_theta": get(f"{arch}.rope.freq_base_swa", 10000.0)}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    return out


def gguf_dtype(matrix_types: set[Any]) -> str:
    """The precision the file's matrices carry (norms are F32 in every file, so only matrices
    count): float32 only when they are F32. Quantized codes (4 to 8 bits times fp16 scales) lose far
    less to bfloat16 rounding than to their own quantization, so they read as bfloat16."""
    from gguf import GGMLQuantizationType as Q

    if matrix_types <= {Q.F32}:
        return "float32"
    return "float16" if matrix_types <= {Q.F32, Q.F16} else "bfloat16"


def auto_mode(matrix_types: set[str]) -> str:
    """What --quantization auto serves for a GGUF whose matrices carry these types: int8 when they
    are all 8-bit (Q8_0), int4 when any carries fewer bits, none when they are all float."""
    quantized = matrix_types - {"F32", "F16", "BF16"}
    if not quantized:
        return "none"
    return "int8" if quantized <= {"Q8_0"} else "int4"
