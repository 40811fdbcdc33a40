"""Sliding windows in the paged cache: when every layer of a model has a window, the blocks that
fell out of it go back to the pool while the request runs. Outputs stay transformers' (greedy,
float32) through chunked prefill, prefix hits (that cover blocks out of the window), preemption by
swap and by recompute and n = 2; every scheduled sequence holds about its window's blocks; a request
longer than the whole pool still runs; at the end every block is back in both pools. A model with a
global layer keeps everything."""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import transformers as T

from engine.block_manager import BlockManager
from engine.build import release_window
from engine.core import EngineCore
from engine.observe.dashboard import Observer
from engine.request import Request
from engine.sequence import Sequence
from shared.config import build_config
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.conftest import save_tiny
from tests.reference import hf_folder_model, hf_greedy

BLOCK = 8
WINDOW = 12
MAX_TOKENS = 28
CHUNK = 16  # max_num_batched_tokens: prompts of 40-90 tokens are prefilled in chunks
ALL_WINDOWED: dict[str, tuple[type, type, dict]] = {
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(head_dim=16, sliding_window=WINDOW)),
    "qwen3-max-window-layers-0": (T.Qwen3Config, T.Qwen3ForCausalLM,
                                  dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=0)),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(pad_token_id=0, sliding_window=WINDOW)),
}


def workload() -> tuple[list[list[int]], list[list[int]]]:
    """Two waves; the second shares a 32-token prefix with the first, so its prefix hits cover
    blocks that are already out of its window."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, 512) for _ in range(32)]
    first = [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(8, 58))] for _ in range(4)]
    second = [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(8, 58))] for _ in range(4)]
    return first, second


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, transformers' greedy outputs of the workload and of the long prompt)."""
    cache = {}

    def get(name, spec):
        if name not in cache:
            config_cls, model_cls, overrides = spec
            folder = save_tiny(tmp_path_factory.mktemp(name), config_cls, model_cls, seed=5,
                               **overrides)
            first, second = workload()
            cache[name] = folder, hf_greedy(hf_folder_model(folder),
                                            first + second + [long_prompt()], MAX_TOKENS)
        return cache[name]
    return get


def long_prompt() -> list[int]:
    rng = random.Random(2)
    return [rng.randrange(3, 512) for _ in range(90)]


def watch(core: EngineCore, bound: int | None) -> dict[str, int]:
    """Checks every plan as it is made: each scheduled sequence holds at most `bound` live blocks
    when it decodes (None: it holds its whole context), and at most its window's and its new tokens'
    blocks. -> what the test reads afterwards: the most blocks released by one sequence, the longest
    prefix hit."""
    sched, bm = core.scheduler, core.block_manager
    seen = {"released": 0, "cached": 0}
    schedule = sched.schedule

    def checked():
        plan = schedule()
        for seq, n in zip(plan.seqs, plan.num_new_tokens):
            live = len(seq.block_table) - seq.released_blocks
            seen["cached"] = max(seen["cached"], seq.request.num_cached_tokens)
            assert seq.block_table[:seq.released_blocks] == [bm.placeholder] * seq.released_blocks
            assert bm.placeholder not in seq.block_table[seq.released_blocks:]
            if bound is None:
                assert seq.released_blocks == 0
                continue
            assert live <= bm.blocks_for(WINDOW + n + BLOCK - 2), (seq, n)
            if n == 1:
                assert live <= bound, (seq, live)
            seen["released"] = max(seen["released"], seq.released_blocks)
        return plan

    sched.schedule = checked  # type: ignore[method-assign]
    return seen


def run(core: EngineCore, waves: list[list[list[int]]], n_first: int = 2,
        each_step: Callable[[], None] | None = None) -> dict[tuple[str, int], list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    pair = SamplingParams(temperature=0, n=n_first, max_tokens=MAX_TOKENS, ignore_eos=True)
    out: dict[tuple[str, int], list[int]] = {}
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            core.add(f"{w}-{i}", p, pair if i == 0 else greedy)
        while core.has_work():
            for o in core.step():
                assert isinstance(o, RequestOutput), o  # an Error here fails the test
                out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if each_step is not None:
                each_step()
    return out


def assert_all_blocks_back(core: EngineCore) -> None:
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.cpu.num_free == bm.cpu.num_blocks
    assert set(bm.ref_counts) == {0} and set(bm.cpu.ref_counts) <= {0}
    assert not core.requests
    # nobody ever wrote the placeholder: it still holds the zeros it started with
    if bm.window is not None:
        assert not core.runner.kv_cache.device[:, :, bm.placeholder].any()


@pytest.mark.parametrize("name", list(ALL_WINDOWED))
@pytest.mark.parametrize("mode,cpu_blocks", [("swap", 64), ("recompute", 0)])
def test_all_windowed_models_release_blocks_and_equal_transformers(checkpoints, name, mode,
                                                                    cpu_blocks):
    folder, ref = checkpoints(name, ALL_WINDOWED[name])
    first, second = workload()
    # 9 usable blocks (+ the placeholder): 5 sequences decoding need up to 3 each, so some must be
    # preempted.
    core = EngineCore(build_config(str(folder), num_blocks=10, block_size=BLOCK,
                                   max_num_batched_tokens=CHUNK, num_cpu_blocks=cpu_blocks,
                                   preemption_mode=mode, num_threads=1))
    bm = core.block_manager
    assert bm.window == WINDOW and bm.num_blocks == 9
    seen = watch(core, -(-WINDOW // BLOCK) + 1)
    observer = Observer(core)

    def dashboard_agrees() -> None:  # the dashboard's block map skips the placeholder entries
        snap = observer.snapshot()
        assert sum(h >= 0 for h in snap["blocks"]) == bm.num_blocks - bm.num_free_blocks

    out = run(core, [first, second], each_step=dashboard_agrees)
    rids = [f"0-{i}" for i in range(len(first))] + [f"1-{i}" for i in range(len(second))]
    assert [out[(rid, 0)] for rid in rids] == ref[:-1]
    # n = 2, greedy: the same twice
    assert out[("0-0", 1)] == ref[0] and out[("1-0", 1)] == ref[len(first)]
    stats = core.stats()
    assert stats[f"num_preemptions_{mode}"] > 0
    # A 32-token hit starts its request with 2 blocks out of its window (not taken at all).
    assert seen["cached"] >= 32 and stats["total_prefix_hits_tokens"] >= 32, \
        "the second wave hits the prefix"
    assert seen["released"] >= (90 + MAX_TOKENS - WINDOW) // BLOCK - 1, \
        "old blocks were really released"
    assert_all_blocks_back(core)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_request_longer_than_the_pool_runs_in_its_window(checkpoints, backend):
    """90 + 28 tokens need 15 blocks; the pool has 6. Both CPU attention paths (native kernel for
    decodes, batched SDPA) read the placeholder of released blocks."""
    folder, ref = checkpoints("mistral", ALL_WINDOWED["mistral"])
    core = EngineCore(build_config(str(folder), num_blocks=7, block_size=BLOCK,
                                   max_num_batched_tokens=CHUNK, num_cpu_blocks=0,
                                   attention_backend=backend, num_threads=1))
    assert core.max_model_len > 90 + MAX_TOKENS > core.block_manager.num_blocks * BLOCK
    watch(core, -(-WINDOW // BLOCK) + 1)
    out = run(core, [[long_prompt()]], n_first=1)
    assert out[("0-0", 0)] == ref[-1]
    assert_all_blocks_back(core)


def test_a_model_with_a_global_layer_keeps_every_block(tmp_path):
    """Gemma 3 alternating sliding and full layers: the full layer reads the whole context."""
    folder = save_tiny(tmp_path, T.Gemma3TextConfig, T.Gemma3ForCausalLM, seed=5, head_dim=16,
                       sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    first, second = workload()
    ref = hf_greedy(hf_folder_model(folder), first + second, MAX_TOKENS)
    core = EngineCore(build_config(str(folder), num_blocks=40, block_size=BLOCK,
                                   max_num_batched_tokens=CHUNK, num_cpu_blocks=16, num_threads=1))
    assert core.block_manager.window is None and core.block_manager.num_blocks == 40
    watch(core, None)
    out = run(core, [first, second])
    rids = [f"0-{i}" for i in range(len(first))] + [f"1-{i}" for i in range(len(second))]
    assert [out[(rid, 0)] for rid in rids] == ref
    assert_all_blocks_back(core)


def test_release_window_only_when_every_layer_has_one_and_it_is_honoured():
    # the largest: every layer must be past a block
    assert release_window((12, 16), True, False) == 16
    assert release_window((12, None), True, False) is None  # a global layer reads everything
    assert release_window((), True, False) is None
    # Triton: context capped at the window anyway
    assert release_window((12, 12), False, False) is None
    assert release_window((12, 12), True, True) is None  # a draft model reads the whole table


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(Request(rid, tokens, SamplingParams(temperature=0, max_tokens=8)))


def test_forks_release_one_reference_each_and_hits_skip_blocks_out_of_the_window():
    bm = BlockManager(11, BLOCK, enable_prefix_caching=True, window=WINDOW)
    assert bm.num_blocks == 10 and bm.placeholder == 10
    parent = _seq("a", list(range(3, 43)))  # 40 tokens: 5 blocks
    bm.allocate(parent, 39)
    parent.num_computed_tokens = 39
    bm.cache_blocks(parent, 0)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.num_free_blocks == 5 and set(bm.ref_counts[b] for b in parent.block_table) == {2}
    bm.release_out_of_window(parent)  # positions < 39 - 12 + 1 = 28: blocks 0-2
    assert parent.released_blocks == 3 and parent.block_table[:3] == [10] * 3
    assert bm.num_free_blocks == 5, "the child still holds them"
    bm.release_out_of_window(child)
    assert bm.num_free_blocks == 8
    # A new request with the same first 32 tokens hits 4 cached blocks, 2 of them out of its window.
    other = _seq("b", list(range(3, 35)) + [7, 7, 7])
    hit = bm.lookup(other)
    assert len(hit.device) == 4
    assert bm.can_allocate_hit(hit, 35)
    assert bm.allocate_hit(other, hit, 35) == 32
    assert other.released_blocks == 2 and other.block_table[:2] == [10, 10]
    assert other.block_table[2:4] == hit.device[2:4] and len(other.block_table) == 5
    for seq in (parent, child, other):
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}


def test_speculative_ngram_drafts_trim_and_release(checkpoints):
    """Prompt lookup drafts (rejected ones trimmed) over released blocks: still transformers'
    tokens."""
    folder, _ = checkpoints("mistral", ALL_WINDOWED["mistral"])
    rng = random.Random(3)
    prompts = []
    for _ in range(3):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randint(4, 7))]
        prompts.append([rng.randrange(3, 512) for _ in range(5)] + phrase * 8)
    ref = hf_greedy(hf_folder_model(folder), prompts, MAX_TOKENS)
    core = EngineCore(build_config(str(folder), num_blocks=12, block_size=BLOCK,
                                   max_num_batched_tokens=CHUNK, num_cpu_blocks=16,
                                   speculative="ngram", num_threads=1))
    seen = watch(core, -(-WINDOW // BLOCK) + 1)
    out = run(core, [prompts], n_first=1)
    assert [out[(f"0-{i}", 0)] for i in range(len(prompts))] == ref
    assert core.stats()["total_spec_draft_tokens"] > 0 and seen["released"] > 0
    assert_all_blocks_back(core)


def test_beam_search_over_released_blocks_equals_transformers(checkpoints):
    """Beams fork every step and share their live blocks; each releases its own references."""
    from tests.engine.test_beam_search import assert_same, engine_beams, hf_beams

    folder, _ = checkpoints("mistral", ALL_WINDOWED["mistral"])
    model = hf_folder_model(folder)
    prompts = [long_prompt()[:40], long_prompt()[40:85]]
    params = SamplingParams(max_tokens=24, use_beam_search=True, beam_width=3, n=2, ignore_eos=True)
    # 3 beams of 40-45 + 24 tokens would need 27 blocks each request; in their windows, 15 at most.
    core = EngineCore(build_config(str(folder), num_blocks=17, block_size=BLOCK,
                                   max_num_batched_tokens=CHUNK, num_cpu_blocks=32, num_threads=1))
    seen = watch(core, -(-WINDOW // BLOCK) + 1)
    for ours, p in zip(engine_beams(core, prompts, params), prompts):
        assert_same(ours, hf_beams(model, p, params, None))
    assert seen["released"] >= 5
    assert_all_blocks_back(core)
