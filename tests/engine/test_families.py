"""Every supported family, with its special features on and off, generates exactly what
transformers' generate does (greedy, float32), token for token, through the engine's hard paths
in one run: chunked prefill, prefix-cache hits, preemption under memory pressure, and n > 1
sharing a prompt.

Each checkpoint is a tiny random model written by transformers' own save_pretrained, so config.json
and the weight names are what the family really ships."""
from __future__ import annotations

import random

import pytest
import transformers as T

from engine.core import EngineCore
from engine.observe.trace import Tracer
from shared.config import build_config
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.conftest import save_tiny
from tests.reference import hf_folder_model, hf_greedy
from tests.traced import prefill_chunks

MAX_TOKENS = 12
BLOCK = 8
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0,
                 short_factor=[1.0 + 0.1 * i for i in range(8)],
                 long_factor=[2.0 + 0.2 * i for i in range(8)])
_LAYERS = ["sliding_attention", "full_attention"]
# name -> (config class, model class, overrides). Windows of 12 tokens are shorter
# than every prompt.
FAMILIES: dict[str, tuple[type, type, dict]] = {
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=16)),
    "qwen3-window": (T.Qwen3Config, T.Qwen3ForCausalLM,
                     dict(head_dim=16, use_sliding_window=True, sliding_window=12,
                          max_window_layers=1)),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(pad_token_id=0)),
    "phi3-longrope": (T.Phi3Config, T.Phi3ForCausalLM,
                      dict(pad_token_id=0, original_max_position_embeddings=256,
                           rope_parameters=_LONGROPE)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM,
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4096,
                    attn_logit_softcapping=None,
                    final_logit_softcapping=None)),
    "gemma2-softcap-window": (T.Gemma2Config, T.Gemma2ForCausalLM,
                              dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               dict(head_dim=16, sliding_window=4096, layer_types=["full_attention"] * 2)),
    "gemma3-window": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
                      dict(head_dim=16, sliding_window=12, layer_types=_LAYERS)),
    "qwen3moe-top2-of-4": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                           dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32)),
    "qwen3moe-top1-normed-every-2nd": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                                       dict(head_dim=16, num_experts=4, num_experts_per_tok=1,
                                            norm_topk_prob=True,
                                            moe_intermediate_size=32, decoder_sparse_step=2)),
}


def workload() -> tuple[list[list[int]], list[list[int]]]:
    """Two waves: the second shares a 24-token prefix with the first (prefix-cache hits); prompts up
    to 70 tokens are chunked by a 32-token budget."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 512) for _ in range(24)]
    first = [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    second = [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(5, 46))] for _ in range(4)]
    return first, second


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_through_chunks_prefix_hits_preemption_and_n(family, tmp_path):
    config_cls, model_cls, overrides = FAMILIES[family]
    folder = save_tiny(tmp_path, config_cls, model_cls, seed=3, **overrides)
    first, second = workload()
    ref = hf_greedy(hf_folder_model(folder), first + second, MAX_TOKENS)
    # 20 blocks of 8 hold about a third of the second wave: it must preempt.
    core = EngineCore(build_config(str(folder), num_blocks=20, block_size=BLOCK,
                                   max_num_batched_tokens=32, num_cpu_blocks=8, num_threads=1))
    tracer = Tracer()
    core.set_tracer(tracer)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out: dict[tuple[str, int], list[int]] = {}
    for wave, prompts in (("a", first), ("b", second)):
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0, n=2, max_tokens=MAX_TOKENS,
                                    ignore_eos=True) if i == 0 else greedy
            core.add(f"{wave}{i}", p, params)
        while core.has_work():
            for o in core.step():
                assert isinstance(o, RequestOutput), o  # an Error here fails the test
                out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    rids = [f"a{i}" for i in range(len(first))] + [f"b{i}" for i in range(len(second))]
    assert [out[(rid, 0)] for rid in rids] == ref
    assert out[("a0", 1)] == ref[0] and out[("b0", 1)] == ref[len(first)]  # n = 2: both samples
    stats = core.stats()
    assert stats["total_prefix_hits_tokens"] > 0
    assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] > 0
    # prompts went in chunks
    assert max(n for chunks in prefill_chunks(tracer).values() for n in chunks) <= 32


def test_a_backend_without_windows_serves_up_to_the_window_and_one_without_softcap_refuses():
    from types import SimpleNamespace

    from engine.models import ModelConfig
    from kernels.backend import backend_limit

    base = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 4096, "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
            "hidden_activation": "gelu_pytorch_tanh"}
    plain = SimpleNamespace(supports_window=False, supports_softcap=False)
    full = SimpleNamespace(supports_window=True, supports_softcap=True)
    cfg = ModelConfig.from_hf({**base, "attn_logit_softcapping": None})
    assert backend_limit(cfg, plain) == 512 and backend_limit(cfg, full) == 4096
    with pytest.raises(ValueError, match="soft-caps attention scores.*--attention-backend torch"):
        backend_limit(ModelConfig.from_hf({**base, "attn_logit_softcapping": 50.0}), plain)
