"""The engine against transformers' own generate, and the paging / batching promises of
the design."""
from __future__ import annotations

import random

import pytest

from engine.core import EngineCore
from engine.observe.trace import Tracer
from engine.offline import LLM
from shared.config import build_config
from shared.sampling import SamplingParams
from tests.conftest import request_outputs
from tests.reference import hf_folder_model, hf_greedy, transformers_gguf_model
from tests.traced import step_sizes

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# Qwen2 only in make test: test_families.py compares every family with transformers in
# make check too.
@pytest.mark.parametrize("fixture",
                         ["tiny_llama_dir", pytest.param("tiny_qwen2_dir", marks=pytest.mark.slow)])
def test_greedy_equals_transformers_generate(fixture, request):
    folder = request.getfixturevalue(fixture)
    prompts = random_prompts(8, vocab=512)
    llm = LLM(str(folder), num_blocks=128, block_size=16, max_num_batched_tokens=128)
    ours = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == hf_greedy(hf_folder_model(folder), prompts, GREEDY.max_tokens)


@pytest.mark.slow
def test_smollm2_gguf_greedy_equals_transformers_generate(smollm2_source):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_source.folder, gguf_file=smollm2_source.gguf_file)
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,",
             "The quick brown fox",
             "Explain photosynthesis to a child in three sentences, please. " * 3,
             "def fibonacci(n):", "Name three colors.", "Once upon a time in a land far away, " * 8]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # float32 and no quantization pinned: --dtype auto would serve this 4-bit GGUF in bfloat16
    # on a CPU with AMX, and --quantization auto as int4 (tests/engine/test_quantized.py
    # covers that path).
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", quantization="none",
              kv_cache_memory="256MiB", max_num_batched_tokens=1024)
    tracer = Tracer()
    llm.core.set_tracer(tracer)
    ours = llm.generate(prompts, params, use_tqdm=False)
    # All eight decoded side by side in one batch, not one after another.
    assert max(step_sizes(tracer)) == 8
    ref = hf_greedy(transformers_gguf_model(smollm2_source), prompts, 48)
    assert [o.token_ids for o in ours] == ref


# two engines over the same prompts; test_block_manager.py pins the free-list order itself
@pytest.mark.slow
def test_scrambled_free_list_gives_identical_outputs(tiny_llama_dir):
    prompts = random_prompts(6, vocab=512, seed=1, lo=20, hi=90)
    cfg = build_config(str(tiny_llama_dir), num_blocks=96, block_size=16, max_num_batched_tokens=64)
    plain = EngineCore(cfg)
    order = list(range(96))
    random.Random(7).shuffle(order)
    scrambled = EngineCore(cfg)
    pool = scrambled.block_manager.device
    for _ in order:  # every block taken, then freed in a scrambled order: handed out in that order
        pool.take()
    pool.release(order)
    results = []
    for core in (plain, scrambled):
        for i, p in enumerate(prompts):
            core.add(f"r{i}", p, GREEDY)
        tables: dict[str, list[int]] = {}
        toks: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while core.has_work():
            for out in request_outputs(core.step()):
                toks[out.request_id] += out.new_token_ids
            for rid, live in core.requests.items():
                tables[rid] = list(live.root.block_table)
        results.append((toks, tables))
    assert results[0][0] == results[1][0]
    long_tables = [t for t in results[1][1].values() if len(t) > 2]
    assert long_tables, "some sequence must span several blocks"
    assert any(t != list(range(t[0], t[0] + len(t)))
               for t in long_tables), "blocks must be non-contiguous"
    assert scrambled.block_manager.num_free_blocks == 96


def test_request_joins_running_batch_next_step_and_blocks_return(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=16))
    core.add("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    core.add("b", [9, 10, 11], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        core.step()
    core.add("late", [12, 13, 14, 15, 16],
             SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = request_outputs(core.step())
    last = core.last_step
    # joined at once, prefilled beside two decodes
    assert {o.request_id: len(o.new_token_ids) for o in outs} == {"a": 1, "b": 1, "late": 1}
    assert (last["step_num_seqs"], last["step_prefill_tokens"],
            last["step_decode_tokens"]) == (3, 5, 2)
    while core.has_work():
        core.step()
    assert core.block_manager.num_free_blocks == 64
    assert core.block_manager.ref_counts == [0] * 64


def test_finished_request_frees_blocks_in_the_same_step(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=16))
    core.add("long", list(range(3, 40)),
             SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    core.add("short", list(range(3, 40)),
             SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    core.step()
    held = 64 - core.block_manager.num_free_blocks
    outs = request_outputs(core.step())
    assert any(o.request_id == "short" and o.finished for o in outs)
    assert 64 - core.block_manager.num_free_blocks == held // 2  # short's 3 blocks are back


def test_abort_frees_blocks_and_is_idempotent(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=32, block_size=16))
    core.add("x", list(range(3, 50)),
             SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    core.step()
    assert core.block_manager.num_free_blocks < 32
    assert [o.finish_reason for o in request_outputs(core.abort(["x"]))] == ["abort"]
    assert core.abort(["x", "never-seen"]) == []
    assert core.block_manager.num_free_blocks == 32 and not core.has_work()


def test_prompt_that_can_never_fit_is_rejected_and_others_continue(tiny_llama_dir):
    from shared.errors import InvalidRequest

    # 64 tokens fit
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=4, block_size=16))
    with pytest.raises(InvalidRequest, match="at most 64 tokens"):
        core.add("huge", list(range(3, 100)), GREEDY)
    core.add("ok", [3, 4, 5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    got: list[int] = []
    while core.has_work():
        got += [t for o in request_outputs(core.step()) for t in o.new_token_ids]
    assert len(got) == 5


def test_max_model_len_option_narrows_the_engine_limit(tiny_llama_dir) -> None:
    """The offline API's max_model_len reaches the scheduler and the admission limits alike."""
    from engine.offline import LLM

    llm = LLM(str(tiny_llama_dir), num_threads=1, kv_cache_memory="8MiB", max_model_len=40)
    core = llm.core
    assert core.max_model_len == core.scheduler.max_model_len == core.limits.max_model_len == 40
