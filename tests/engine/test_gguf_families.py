"""Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE from GGUF files as llama.cpp writes them.

Each GGUF is written from a tiny transformers checkpoint the way llama.cpp's convert_hf_to_gguf.py
does it: tensor names from the `gguf` package's own TensorNameMap, 1 added to every Gemma RMSNorm
weight, Qwen3-MoE experts stacked into one [E, out, in] tensor per projection, Phi-3's LongRoPE
factors as rope_factors_long / rope_factors_short tensors, and the metadata keys that converter
writes. The engine's greedy output is compared token for token with transformers' generate on the
original model."""
from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import transformers as T

from engine.core import EngineCore
from engine.load.gguf import read_gguf
from engine.load.quant import Int4Linear
from engine.load.weights import load_model
from shared.config import build_config
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.conftest import causal_lm, decoder_layers, request_outputs, save_tiny
from tests.engine.test_quantized import logits
from tests.reference import hf_folder_model, hf_greedy

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

MAX_TOKENS = 12
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0,
                 short_factor=[1.0 + 0.1 * i for i in range(8)],
                 long_factor=[2.0 + 0.2 * i for i in range(8)])
# llama.cpp's fixed Gemma 3 pattern (6)
_GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
_GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
# name -> (llama.cpp arch, config class, model class, overrides). llama.cpp scales Gemma's q by
# 1/sqrt(head_dim) (not the 27B's layer counts), so query_pre_attn_scalar = head_dim; it always
# renormalises Qwen3-MoE's top-k weights, so norm_topk_prob = True. Windows of 12 are shorter
# than the prompts.
FAMILIES: dict[str, tuple[str, type, type, dict]] = {
    "gemma2-softcap-window": ("gemma2", T.Gemma2Config, T.Gemma2ForCausalLM,
                              dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3-window-global-linear-rope": ("gemma3", T.Gemma3TextConfig, T.Gemma3ForCausalLM,
                                         dict(head_dim=16, query_pre_attn_scalar=16,
                                              sliding_window=12,
                                              num_hidden_layers=6, layer_types=_GEMMA3_LAYERS,
                                              rope_parameters=_GEMMA3_ROPE)),
    "phi3-longrope": ("phi3", T.Phi3Config, T.Phi3ForCausalLM,
                      dict(pad_token_id=0, original_max_position_embeddings=256,
                           rope_parameters=_LONGROPE)),
    "qwen3moe-top2-of-4": ("qwen3moe", T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                           dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32,
                                norm_topk_prob=True)),
}


def write_llama_cpp_gguf(folder: Path, path: Path, arch: str,
                         quantize: dict[str, GGMLQuantizationType] | None = None) -> Path:
    """A GGUF of the HF checkpoint in folder, named, transformed and described as llama.cpp's
    converter does for arch. quantize: GGUF tensor name suffix (e.g. 'attn_q.weight') ->
    GGMLQuantizationType; everything else is F32."""
    import gguf
    from gguf.quants import quantize as gguf_quantize
    from safetensors.torch import load_file

    c = json.loads((folder / "config.json").read_text())
    n_layers = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     n_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = c["rope_parameters"]
    # transformers v5 writes the latter
    n_experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if arch == "gemma2":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
    # the sliding layers' base (10000) and pattern (6) are llama.cpp's constants
    elif arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(c["sliding_window"])
    elif arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(c.get("sliding_window") or 0)
        orig = rope["original_max_position_embeddings"]
        stretch = c["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(stretch) / math.log(orig)))
        w.add_tensor("rope_factors_long.weight",
                     torch.tensor(rope["long_factor"], dtype=torch.float32).numpy())
        w.add_tensor("rope_factors_short.weight",
                     torch.tensor(rope["short_factor"], dtype=torch.float32).numpy())
    elif arch == "qwen3moe":
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(n_experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(c["vocab_size"])])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    state = load_file(folder / "model.safetensors")
    if arch.startswith("gemma"):
        state.pop("lm_head.weight", None)  # llama.cpp skips it: Gemma's head is the embedding
    experts: dict[str, list[torch.Tensor]] = {}
    # llama.cpp stacks each projection's experts into one [E, out, in] tensor
    for i in range(n_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{proj}.weight"
            parts = [state.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight")
                     for e in range(n_experts)]
            if parts:
                experts[key] = parts
    items = [*state.items(), *((k, torch.stack(v)) for k, v in experts.items())]
    for name, t in items:
        base, kind = name.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, (arch, name)
        gname = f"{gname}.{kind}"
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # Gemma's RMSNorm is x * (1 + w); llama.cpp stores 1 + w
        a = t.float().contiguous().numpy()
        qtype = next((q for s, q in (quantize or {}).items() if gname.endswith(s)), None)
        if qtype is None:
            w.add_tensor(gname, a)
        else:
            w.add_tensor(gname, gguf_quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def prompts() -> list[list[int]]:
    """Up to 40 tokens: longer than every window, shorter than Phi-3's original context (LongRoPE's
    short factors, where transformers and the engine agree)."""
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(14, 40))] for _ in range(4)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_greedy_equals_transformers_on_the_original_model(family, tmp_path):
    arch, config_cls, model_cls, overrides = FAMILIES[family]
    folder = save_tiny(tmp_path / "hf", config_cls, model_cls, seed=3, **overrides)
    path = write_llama_cpp_gguf(folder, tmp_path / f"{family}.gguf", arch)
    ps = prompts()
    ref = hf_greedy(hf_folder_model(folder), ps, MAX_TOKENS)
    core = EngineCore(build_config(str(path), dtype="float32", num_blocks=64, block_size=8,
                                   max_num_batched_tokens=16, num_threads=1))
    assert core.model_config.architecture == model_cls.__name__
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(ps):
        core.add(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    while core.has_work():
        for o in request_outputs(core.step()):
            out[o.request_id] += o.new_token_ids
    assert [out[f"r{i}"] for i in range(len(ps))] == ref


def test_gguf_configs_carry_each_familys_switches(tmp_path):
    """What the files say (or llama.cpp assumes) lands in the same config the HF folder gives."""
    from engine.models import ModelConfig

    for family, (arch, config_cls, model_cls, overrides) in FAMILIES.items():
        folder = save_tiny(tmp_path / family, config_cls, model_cls, seed=3, **overrides)
        config, tensors, _ = read_gguf(write_llama_cpp_gguf(folder, tmp_path / f"{family}.gguf",
                                                            arch))
        ours = ModelConfig.from_hf(config)
        hf = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        for field in ("architecture", "head_dim", "hidden_act", "qk_norm", "sandwich_norms",
                      "embed_scale", "attn_scale", "attn_softcap", "final_softcap", "layer_windows",
                      "local_rope_theta", "rope_theta", "num_experts", "num_experts_per_tok",
                      "moe_intermediate_size", "norm_topk_prob", "sparse_layers",
                      "tie_word_embeddings"):
            assert getattr(ours, field) == getattr(hf, field), (family, field)
        assert (ours.rope_scaling is None) == (hf.rope_scaling is None), family
        if hf.rope_scaling is not None and ours.rope_scaling is not None:
            for k, v in hf.rope_scaling.items():
                if v is not None and k != "attention_factor":
                    assert ours.rope_scaling[k] == pytest.approx(v), (family, k)
        if arch.startswith("gemma"):  # the +1 llama.cpp added to every norm is undone
            assert all(torch.equal(t, torch.zeros_like(t)) for n, t in tensors.items()
                       if n.endswith("norm.weight"))


def test_gemma_window_pattern_from_the_file_replaces_llama_cpps_default(tmp_path):
    folder = save_tiny(tmp_path / "hf", T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=16,
                       query_pre_attn_scalar=16, sliding_window=12,
                       layer_types=["sliding_attention", "full_attention"])
    path = write_llama_cpp_gguf(folder, tmp_path / "default.gguf", "gemma3")
    # pattern 6: both layers slide
    assert read_gguf(path)[0]["layer_types"] == ["sliding_attention"] * 2

    import gguf

    from engine.load.gguf_config import gguf_config

    slide, full = "sliding_attention", "full_attention"
    for pattern, expected in ((2, [slide, full]), ([False, True], [full, slide])):
        p = tmp_path / f"pattern-{pattern}.gguf"
        w = gguf.GGUFWriter(str(p), "gemma3")
        for key, value in (("block_count", 2), ("embedding_length", 64),
                           ("attention.head_count", 4), ("attention.sliding_window", 12)):
            w.add_uint32(f"gemma3.{key}", value)
        w.add_sliding_window_pattern(pattern)
        w.add_token_list([f"t{i}" for i in range(8)])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        assert gguf_config(gguf.GGUFReader(p))["layer_types"] == expected


def test_quantized_qwen3moe_gguf_loads_q4_0_attention_and_q8_0_experts(tmp_path):
    """Q4_0 attention matrices (exact int4 groups) and Q8_0 3-D expert stacks: dequantized, the
    model equals transformers' with the same dequantized weights; served as int4, the attention
    carries the file's codes."""
    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    Q = gguf.GGMLQuantizationType
    _, config_cls, model_cls, overrides = FAMILIES["qwen3moe-top2-of-4"]
    folder = save_tiny(tmp_path / "hf", config_cls, model_cls, seed=3, **overrides)
    qtypes = {f"attn_{p}.weight": Q.Q4_0
              for p in ("q", "k", "v", "output")} | {"_exps.weight": Q.Q8_0}
    source = resolve_model(str(write_llama_cpp_gguf(folder, tmp_path / "q.gguf", "qwen3moe",
                                                    qtypes)))
    state = load_file(folder / "model.safetensors")
    for name, t in state.items():  # the reference: transformers with the file's dequantized values
        qtype = (Q.Q4_0 if ".self_attn." in name and t.ndim == 2
                 else Q.Q8_0 if ".experts." in name else None)
        if qtype is not None:
            state[name] = torch.from_numpy(dequantize(quantize(t.numpy(), qtype), qtype).copy())
    ref_folder = tmp_path / "dequantized"
    ref_folder.mkdir()
    shutil.copy(folder / "config.json", ref_folder / "config.json")
    save_file(state, str(ref_folder / "model.safetensors"), metadata={"format": "pt"})
    ids = random.Random(3).sample(range(3, 512), 30)
    with torch.no_grad():
        ref = hf_folder_model(ref_folder)(torch.tensor([ids])).logits[0]
    plain, cfg = load_model(source, torch.float32, "cpu", "none")
    assert cfg.num_experts == 4 and cfg.quantization == "none"
    torch.testing.assert_close(logits(plain, cfg, ids), ref, atol=1e-4, rtol=1e-4)
    # int4 from Q4_0 is exact: with the re-quantized embedding and head put back in float32, only
    # float rounding remains (the router and the experts are never quantized).
    model, cfg = load_model(source, torch.float32, "cpu", "int4")
    assert cfg.quantization == "int4" and isinstance(decoder_layers(model)[0].qkv_proj, Int4Linear)
    lm, plain_lm = causal_lm(model), causal_lm(plain)
    lm.model.embed_tokens, lm.lm_head = plain_lm.model.embed_tokens, plain_lm.lm_head
    torch.testing.assert_close(logits(model, cfg, ids), ref, atol=1e-3, rtol=1e-3)


def test_an_unknown_gguf_architecture_is_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'falcon' is not supported; supported: ") as e:
        read_gguf(path)
    assert all(a in str(e.value) for a in ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2",
                                           "gemma3"))
