"""Weight loading: config normalisation, the registry, the GGUF q/k permutation, and SmolLM2's GGUF
weights equal to what transformers' own GGUF loader produces."""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.load.gguf import from_interleaved
from engine.load.weights import dequantized_folder, load_model
from engine.models import MODELS, ModelConfig, get_model_class
from engine.models.llama import LlamaForCausalLM, to_interleaved
from tests.reference import transformers_gguf_model

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "eos_token_id": 2}


def test_registry_knows_the_llama_family_and_refuses_others():
    assert set(MODELS) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM"}
    assert get_model_class("Qwen2ForCausalLM") is LlamaForCausalLM
    with pytest.raises(ValueError,
                       match="unsupported architecture 'GPT2LMHeadModel'; supported: "
                             "Gemma2ForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError,
                       match="unsupported architecture 'GPT2LMHeadModel'; supported: "
                             ".*Qwen3ForCausalLM"):
        ModelConfig.from_hf({**LLAMA, "architectures": ["GPT2LMHeadModel"]})


def test_config_reads_old_and_new_rope_spellings():
    old = ModelConfig.from_hf({**LLAMA, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_hf({**LLAMA, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert old == new and old.rope_theta == 500000.0 and old.rope_scaling is not None
    assert old.rope_scaling["rope_type"] == "llama3"
    plain = ModelConfig.from_hf({**LLAMA,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 16 and plain.num_kv_heads == 2
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="needs factor"):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": {"rope_type": "linear"}})


def test_config_normalises_family_differences():
    qwen = ModelConfig.from_hf({**LLAMA, "architectures": None, "model_type": "qwen2",
                                "sliding_window": 64, "use_sliding_window": False,
                                "max_position_embeddings": 512})
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.attention_bias and not qwen.o_proj_bias
    assert qwen.max_position_embeddings == 512 and qwen.layer_windows == ()  # window unused
    mistral = ModelConfig.from_hf({**LLAMA, "architectures": ["MistralForCausalLM"],
                                   "sliding_window": 256, "max_position_embeddings": 32768})
    # every layer
    assert mistral.max_position_embeddings == 32768 and mistral.layer_windows == (256, 256)
    gemma = ModelConfig.from_hf({**LLAMA, "architectures": ["Gemma2ForCausalLM"],
                                 "sliding_window": 8,
                                 "layer_types": ["sliding_attention", "full_attention"],
                                 "hidden_activation": "gelu_pytorch_tanh",
                                 "attn_logit_softcapping": 50.0})
    assert gemma.layer_windows == (8, None)
    assert gemma.attn_softcap == 50.0
    assert gemma.tie_word_embeddings
    eos = ModelConfig.from_hf({**LLAMA, "eos_token_id": [2, 7]},
                              generation_config={"eos_token_id": [7, 9]})
    assert eos.eos_token_ids == [2, 7, 9] and not eos.attention_bias


@pytest.mark.parametrize("legacy", [
    {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
     "sliding_window_pattern": 3,
     "rope_local_base_freq": 5000.0, "rope_theta": 1e6,
     "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    # pattern 6
    {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "rope_theta": 1e6},
    {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"},  # every 2nd layer global
])
def test_gemma_configs_without_layer_types_read_as_transformers_reads_them(legacy):
    """Hub configs written before `layer_types` existed: windows and local RoPE as transformers' own
    config class derives them (its to_dict() spells them out), not every layer global."""
    import transformers as T

    d = {**LLAMA, "num_hidden_layers": 8, "sliding_window": 16,
         "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None,
         "final_logit_softcapping": None, **legacy}
    cls = T.Gemma3TextConfig if legacy["model_type"] == "gemma3_text" else T.Gemma2Config
    theirs = cls(**{k: v for k, v in d.items() if k != "architectures"}).to_dict()
    ours = ModelConfig.from_hf(d)
    reference = ModelConfig.from_hf({**theirs, "architectures": d["architectures"]})
    assert ours.layer_windows == reference.layer_windows and ours.has_windows
    assert (ours.rope_theta, ours.local_rope_theta, ours.rope_scaling) == (
        reference.rope_theta, reference.local_rope_theta, reference.rope_scaling)


def test_gguf_unpermute_inverts_llama_cpp_and_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    for heads, rows in ((4, 64), (2, 32)):
        w = torch.randn(rows, 24)
        gguf_order = to_interleaved(w, heads)  # what llama.cpp's converter stores
        assert not torch.equal(gguf_order, w)
        assert torch.equal(from_interleaved(gguf_order, heads), w)
        theirs = LlamaTensorProcessor()._reverse_permute_weights(gguf_order.numpy(), heads, heads)
        assert np.array_equal(theirs, w.numpy())
        b = torch.randn(rows)  # biases permute the same way
        assert torch.equal(from_interleaved(to_interleaved(b, heads), heads), b)


# ---------------------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def smollm2_loads(smollm2_source, conveyor_cache, tmp_path_factory):
    """(model, config, log records) of the first load, which dequantizes and fills the cache.
    The module gets a cache folder of its own: other tests of the session may have filled the
    shared one."""
    os.environ["CONVEYOR_CACHE"] = str(tmp_path_factory.mktemp("weights-cache"))
    try:
        yield _first_load(smollm2_source)
    finally:
        os.environ["CONVEYOR_CACHE"] = str(conveyor_cache)


def _first_load(smollm2_source):
    handler = _Collect()
    log = logging.getLogger("conveyor.weights")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        # matrices to compare
        model, cfg = load_model(smollm2_source, torch.float32, "cpu", prepack=False)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    return model, cfg, handler.messages


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.slow
def test_smollm2_gguf_equals_transformers_gguf_loader(smollm2_source, smollm2_loads):
    model, cfg, _ = smollm2_loads
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size) == (30, 576, 9, 3, 49152)
    # <|im_end|>, <|im_start|>
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    hf = transformers_gguf_model(smollm2_source)
    theirs = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    # The cache folder holds HF names and HF q/k order: every tensor equals transformers' exactly.
    cached = load_file(dequantized_folder(smollm2_source) / "model.safetensors")
    assert cached.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(cached[name], t), name
    # And the loaded model holds the same numbers, fused and in its RoPE row order.
    ours = model.state_dict()
    for name, t in model.convert_hf_weights(iter(theirs.items())).items():
        assert torch.equal(ours[name], t), name
    # Logits on a short prompt, ours through the paged batch vs transformers' forward.
    ids = [1, 4093, 314, 260, 3575, 282, 4649, 47, 2, 198]
    kv = torch.zeros(30, 2, 4, 16, 3, 64)
    from kernels.backend import BatchLayout
    from kernels.torch_backend import TorchBackend

    backend = TorchBackend()
    layout = BatchLayout([len(ids)], [0], [[3]], 16, torch.arange(48, 48 + len(ids)))
    with torch.inference_mode():
        got = model(torch.tensor(ids), torch.arange(len(ids)), kv, backend.plan(layout), backend,
                    torch.arange(len(ids)))
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)  # seen: 9e-5 on logits of ~40
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_smollm2_second_load_comes_from_cache(smollm2_source, smollm2_loads, caplog):
    first, _, first_logs = smollm2_loads
    assert any(m.startswith("dequantized") for m in first_logs)
    cache = dequantized_folder(smollm2_source)
    assert (cache / "config.json").is_file() and (cache / "model.safetensors").is_file()
    with caplog.at_level(logging.INFO, logger="conveyor.weights"):
        # matrices to compare
        model, cfg = load_model(smollm2_source, torch.float32, "cpu", prepack=False)
    messages = [r.getMessage() for r in caplog.records if r.name == "conveyor.weights"]
    assert not any("GGUF" in m or m.startswith("dequantized") for m in messages), messages
    assert any(m.startswith("loaded") and f"from {cache} in" in m for m in messages), messages
    assert cfg == smollm2_loads[1]
    # The file's matrices are 4-bit (Q4_1): the cache says so, for --dtype auto
    # (engine/load/dtype.py).
    assert json.loads((cache / "config.json").read_text())["torch_dtype"] == "bfloat16"
    theirs = first.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, theirs[name]), name
