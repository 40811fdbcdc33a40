"""One model graph at every tensor-parallel size: TP=2 equal to TP=1 (float32, greedy and seeded,
token for token) for the switches of engine/models/llama.py that test_tensor_parallel.py's Llama and
Qwen2 checkpoints leave off, for int8 weights, and for speculative decoding. Each test is the reason
its refusal in engine/distributed/shard.py (or engine/core.py) was lifted."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as T

from engine.load.quant import Int8Linear
from tests.conftest import TINY, save_tiny
from tests.distributed.test_tensor_parallel import assert_tp2_equals_tp1, tp_engine
from tests.distributed.workload import workload

_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0,
                 short_factor=[1.0 + 0.1 * i for i in range(8)],
                 long_factor=[2.0 + 0.2 * i for i in range(8)])
_GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
# name -> (config class, model class, overrides), with what each switches on. Windows of 12 tokens
# are shorter than the prompts; a vocabulary of 509 leaves the last rank's rows padded.
FAMILIES: dict[str, tuple[type, type, dict]] = {
    # GeGLU, sandwich norms, the embedding scale, a tied head, soft caps on scores and logits,
    # query_pre_attn_scalar, a window on every other layer
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM,
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                    attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, vocab_size=509)),
    # q/k norms, windowed layers with their own RoPE base beside a global one with linear scaling
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=12,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters=_GEMMA3_ROPE)),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=16)),  # q/k norms
    # q/k/v and gate/up fused in the checkpoint (a rank reads three and two row ranges), LongRoPE
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM,
             dict(pad_token_id=0, original_max_position_embeddings=256, rope_parameters=_LONGROPE)),
    # a window on every layer: blocks the window has passed are released on every rank
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=12)),
}


POOL = dict(num_blocks=256, num_cpu_blocks=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_equals_tp1(family: str, tmp_path: Path) -> None:
    config_cls, model_cls, overrides = FAMILIES[family]
    folder = save_tiny(tmp_path, config_cls, model_cls, seed=3, **overrides)
    assert_tp2_equals_tp1(folder, workload(int(overrides.get("vocab_size", 512))), POOL, POOL)


@pytest.fixture(scope="module")
def llama_with_biases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with biases on q/k/v and on o_proj (attention_bias), all drawn nonzero: the
    row-parallel o_proj's bias must be added once, not once per rank."""
    torch.manual_seed(4)
    model = T.LlamaForCausalLM(T.LlamaConfig(**{**TINY, "attention_bias": True})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                proj.bias.normal_(0, 0.1)
    folder = tmp_path_factory.mktemp("tiny-llama-biases")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_biases_and_int8_weights_tp2_equal_tp1(llama_with_biases: Path, quantization: str) -> None:
    """int8: every rank's codes and scales are the unsplit matrices' (row-parallel ones through the
    rows' absmax over all ranks), so both sizes multiply by the same weights. int4: a group is 32
    columns of a row, and the row-parallel ranks split their columns at 32 (o_proj) and 64
    (down_proj), so every rank's groups are the unsplit matrices'."""
    options = dict(POOL, quantization=quantization)
    assert_tp2_equals_tp1(llama_with_biases, workload(), options, options)


def test_int8_column_slices_with_the_whole_rows_absmax_are_the_whole_matrix_codes() -> None:
    """A row-parallel rank holds some columns of each row; with the rows' absmax over all columns
    (an all-reduce at load) its codes and scales are exactly the unsplit matrix's."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    whole = Int8Linear(w, None, torch.float32)
    absmax = w.abs().amax(dim=1)
    for cols in (slice(0, 32), slice(32, 64)):
        part = Int8Linear(w[:, cols], None, torch.float32, absmax)
        assert torch.equal(part.codes(), whole.codes()[:, cols])
        assert torch.equal(part.scales, whole.scales)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_at_tp2_equals_tp1(tiny_llama_dir: Path, method: str) -> None:
    """Rank 0 proposes (prompt lookup, or a whole draft model of its own) and the sharded
    forward verifies the drafts' rows: greedy output equals TP=1's without speculation, and
    drafts were verified."""
    from tests.engine.test_speculative import mixed_workload

    reqs = [(f"r{i}", prompt, params)
            for i, (prompt, params) in enumerate(mixed_workload(vocab=512))]
    spec = "ngram" if method == "ngram" else f"draft:{tiny_llama_dir}"
    stats = assert_tp2_equals_tp1(tiny_llama_dir, reqs, POOL,
                                  dict(POOL, speculative=spec, num_speculative_tokens=3))
    assert stats["total_spec_verifications"] > 0 and stats["total_spec_draft_tokens"] > 0
    if method == "draft":  # the target proposing for itself is always right
        assert stats["spec_acceptance_rate"] == 1.0


def test_int4_whose_groups_a_rank_would_cut_is_refused(tmp_path: Path) -> None:
    """A rank's int4 groups equal one engine's only where its columns split at multiples of
    32: an MLP of 96 units (3 groups a row) splits at 48, inside a group. Refused before any
    worker starts."""
    folder = save_tiny(tmp_path, T.LlamaConfig, T.LlamaForCausalLM, intermediate_size=96)
    with pytest.raises(ValueError,
                       match=r"int4 is not sharded at tensor_parallel_size 2: .*down_proj \(48 "
                             r"columns"):
        tp_engine(folder, 2, quantization="int4")


def test_int4_of_a_gguf_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A GGUF's Q4 codes are carried over exactly at TP=1; the ranks read its dequantized cache and
    would quantize it again, so int4 of a GGUF is refused by name (int8 of it is sharded)."""
    from tests.engine.test_quantized import write_gguf

    gguf = write_gguf(tiny_llama_dir, tmp_path / "tiny-q4.gguf")
    with pytest.raises(ValueError, match="int4 of a GGUF is not sharded"):
        tp_engine(gguf, 2, quantization="int4")
