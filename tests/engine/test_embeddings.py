"""Embeddings from the engine (engine/pooling.py) against transformers' own last hidden states,
pooled the same way: whole and chunked prefills, beside generating requests, and every KV block back
afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.core import EngineCore
from engine.observe.trace import Tracer
from shared.config import build_config
from shared.embedding import PoolingParams
from shared.errors import InvalidRequest
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.traced import prefill_chunks


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, make_tiny_checkpoint) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-qwen3"), Qwen3Config, Qwen3ForCausalLM, seed=5, head_dim=16
    )


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, make_tiny_checkpoint) -> Path:
    """A sliding window on every layer: the engine releases the blocks every window has passed."""
    from transformers import MistralConfig, MistralForCausalLM

    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-mistral"),
        MistralConfig,
        MistralForCausalLM,
        seed=6,
        sliding_window=24,
    )


def hf_pooled(folder: Path, ids: list[int], mode: str) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm) pooled by mode, L2-normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]  # [T, E]
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode]
    return F.normalize(v, dim=0)


def embed_all(
    core: EngineCore,
    inputs: dict[str, list[int]],
    generate: dict[str, list[int]] | None = None,
    dimensions: int | None = None,
) -> dict[str, list[float]]:
    """Every input embedded (and every `generate` prompt decoded a few tokens beside them)."""
    for rid, ids in inputs.items():
        core.add(rid, ids, SamplingParams(), pool=PoolingParams(dimensions))
    for rid, ids in (generate or {}).items():
        core.add(rid, ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out: dict[str, list[float]] = {}
    for _ in range(1000):
        if not core.has_work():
            break
        for o in core.step():
            assert isinstance(o, RequestOutput), o
            if o.request_id in inputs:
                assert o.finished and o.new_token_ids == [] and o.embedding is not None
                out[o.request_id] = o.embedding
    assert not core.has_work() and set(out) == set(inputs)
    return out


def cosine(a: list[float], b: torch.Tensor) -> float:
    return float(F.cosine_similarity(torch.tensor(a), b, dim=0))


PROMPTS = {"short": [5, 17, 99, 3], "one": [42], "long": [(7 * i + 3) % 500 for i in range(150)]}


@pytest.mark.parametrize(
    "family,mode", [("qwen3", "last"), ("llama", "mean"), ("llama", "cls"), ("mistral", "mean")]
)
def test_embeddings_equal_transformers_pooled(
    family: str, mode: str, request: pytest.FixtureRequest
) -> None:
    """A 150-token input under a 32-token budget is prefilled in 5+ chunks: mean pooling sums across
    them, last-token pooling takes the last chunk's last row. Decodes run in the same steps."""
    folder = request.getfixturevalue(f"tiny_{family}_dir")
    core = EngineCore(
        build_config(
            str(folder),
            dtype="float32",
            num_blocks=64,
            block_size=8,
            pooling=mode,
            max_num_batched_tokens=32,
            long_prefill_threshold=32,
        )
    )
    free = core.block_manager.num_free_blocks
    assert (core.block_manager.window is not None) == (family == "mistral")
    tracer = Tracer()
    core.set_tracer(tracer)
    got = embed_all(core, PROMPTS, generate={"g1": [9, 8, 7], "g2": list(range(20, 60))})
    for rid, ids in PROMPTS.items():
        ref = hf_pooled(folder, ids, mode)
        assert len(got[rid]) == ref.numel() == 64
        assert cosine(got[rid], ref) > 0.9999, rid
        assert abs(float(torch.tensor(got[rid]).norm()) - 1.0) < 1e-5
    # the long input really was prefilled in several steps
    assert len(prefill_chunks(tracer)["long"]) >= 5
    assert core.block_manager.num_free_blocks == free  # every block back, cached prefixes included


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_embedding_gives_the_same_vector(mode: str, tiny_llama_dir: Path) -> None:
    """A pool too small for everything at once: requests are preempted mid-prefill and the
    mean still equals transformers' (a recompute restarts the sum, a swap keeps it; never
    counted twice)."""
    core = EngineCore(
        build_config(
            str(tiny_llama_dir),
            dtype="float32",
            num_blocks=24,
            block_size=8,
            pooling="mean",
            max_num_batched_tokens=32,
            long_prefill_threshold=8,  # every prompt grows by 8 tokens a step, side by side
            max_long_prefills=4,
            preemption_mode=mode,
            num_cpu_blocks=64,
        )
    )
    # Each input nearly fills the pool alone (22 of 24 blocks): the first to grow
    # preempts the others.
    inputs = {f"e{i}": [(11 * i + 5 * j) % 500 for j in range(170)] for i in range(3)}
    got = embed_all(core, inputs, generate={"g": list(range(100, 160))})
    for rid, ids in inputs.items():
        assert cosine(got[rid], hf_pooled(tiny_llama_dir, ids, "mean")) > 0.9999
    assert core.scheduler.num_preemptions[mode] > 0
    assert core.block_manager.num_free_blocks == 24


def test_bad_embedding_requests_are_refused_naming_the_field(tiny_llama_dir: Path) -> None:
    core = EngineCore(
        build_config(str(tiny_llama_dir), dtype="float32", num_blocks=64, block_size=8)
    )
    assert core.max_model_len == 512  # the model's and the pool's
    cases = [
        ([], None, "input"),
        ([1, 512], None, "input"),
        ([1] * 513, None, "input"),
        ([1, 2], 16, "dimensions"),
    ]
    for ids, dims, param in cases:
        with pytest.raises(InvalidRequest) as e:
            core.add("x", ids, SamplingParams(), pool=PoolingParams(dims))
        assert e.value.param == param, (ids, dims, str(e.value))
    assert "not a Matryoshka model" in str(e.value)
    assert (
        len(embed_all(core, {"fits": [3] * 512})["fits"]) == 64
    )  # the whole context, no token after


def test_matryoshka_and_sentence_transformers_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A checkpoint's own files decide: modules.json + 1_Pooling (mean, no Normalize module) and
    config.json's matryoshka_dimensions; a Dense module makes the server refuse, saying why."""
    folder = tmp_path / "st"
    folder.mkdir()
    for f in tiny_llama_dir.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    core = EngineCore(build_config(str(folder), dtype="float32", num_blocks=64, block_size=8))
    assert (core.pooling.mode, core.pooling.normalize, core.pooling.matryoshka) == (
        "mean",
        False,
        True,
    )
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    got = embed_all(core, {"a": ids}, dimensions=16)["a"]
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).last_hidden_state[0].mean(0)[:16]
    assert torch.allclose(torch.tensor(got), ref, atol=1e-4)
    with pytest.raises(InvalidRequest, match="one of 16, 32, 64"):
        core.add("b", ids, SamplingParams(), pool=PoolingParams(20))
    modules.append(
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (folder / "modules.json").write_text(json.dumps(modules))
    core = EngineCore(build_config(str(folder), dtype="float32", num_blocks=64, block_size=8))
    with pytest.raises(InvalidRequest, match="cannot compute embeddings: .*Dense module"):
        core.add("c", ids, SamplingParams(), pool=PoolingParams())


# sentence-transformers' own pipeline as the reference: about 20 s on 2 busy cores
@pytest.mark.slow
def test_a_qwen3_embedding_style_checkpoint_equals_sentence_transformers(tmp_path: Path) -> None:
    """Qwen3-Embedding's layout: a Qwen3Model (no LM head, tensor names without 'model.') with
    sentence-transformers' last-token Pooling and Normalize modules. --pooling auto reads them, and
    the vectors equal SentenceTransformer(folder).encode of the same texts."""
    from sentence_transformers import SentenceTransformer
    from transformers import Qwen3Config, Qwen3Model

    from tests.conftest import TINY
    from tests.fakes import smollm2_tokenizer

    torch.manual_seed(7)
    Qwen3Model(Qwen3Config(**{**TINY, "vocab_size": 49152, "head_dim": 16})).eval().save_pretrained(
        tmp_path
    )
    smollm2_tokenizer().save_pretrained(tmp_path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "include_prompt": True}
        )
    )
    (tmp_path / "2_Normalize").mkdir()
    texts = ["What is the capital of China?", "Explain gravity", "x"]
    st = SentenceTransformer(str(tmp_path), device="cpu")
    want = st.encode(texts, convert_to_tensor=True, batch_size=1)
    core = EngineCore(
        build_config(
            str(tmp_path),
            dtype="float32",
            num_blocks=64,
            block_size=8,
            max_num_batched_tokens=16,
            long_prefill_threshold=16,
        )
    )
    assert (core.pooling.mode, core.pooling.normalize) == ("last", True)
    ids = {f"t{i}": st.tokenize([t])["input_ids"][0].tolist() for i, t in enumerate(texts)}
    got = embed_all(core, ids)
    for i in range(len(texts)):
        assert cosine(got[f"t{i}"], want[i].float()) > 0.9999
        assert torch.allclose(torch.tensor(got[f"t{i}"]), want[i].float(), atol=1e-4)
