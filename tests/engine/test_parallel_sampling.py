"""n and best_of: the prompt is prefilled once and its blocks are shared by every sample."""
from __future__ import annotations

import pytest

from engine.core import EngineCore
from shared.config import build_config
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.conftest import request_outputs

BS = 16


def collect(core: EngineCore) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    while core.has_work():
        for o in request_outputs(core.step()):
            out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    return out


def test_n4_on_a_300_token_prompt_holds_the_prompt_blocks_once(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=BS,
                                   max_num_batched_tokens=512, enable_prefix_caching=False))
    bm = core.block_manager
    prompt = [3 + i % 500 for i in range(300)]
    core.add("a", prompt, SamplingParams(temperature=0.8, seed=5, n=4, max_tokens=6,
                                         ignore_eos=True))
    core.step()  # prefills 299 tokens once, then forks
    assert (core.last_step["step_num_seqs"], core.last_step["step_prefill_tokens"]) == (1, 299)
    group = core.requests["a"].root.group
    assert group is not None  # n=4 forked the root
    seqs = group.seqs
    assert len(seqs) == 4 and all(s.block_table == seqs[0].block_table for s in seqs)
    table = seqs[0].block_table
    assert len(table) == 19 and 64 - bm.num_free_blocks == 19  # 299 tokens = 18 full blocks + 11
    assert [bm.ref_counts[b] for b in table] == [4] * 19
    # each sequence computes token 300 into the shared partial block: 3 copies, 1 in place
    first = request_outputs(core.step())
    # 1 token each
    assert (core.last_step["step_num_seqs"], core.last_step["step_prefill_tokens"]) == (4, 4)
    assert bm.stats["cow_copies"] == 3
    assert [bm.ref_counts[b] for b in table[:18]] == [4] * 18 and bm.ref_counts[table[18]] == 1
    assert 64 - bm.num_free_blocks == 19 + 3  # four separate requests would hold 4 * 19 = 76
    assert len({s.block_table[18] for s in seqs}) == 4
    out = collect(core)
    for o in first:
        out[(o.request_id, o.index)][:0] = o.new_token_ids
    assert sorted(out) == [("a", i) for i in range(4)] and all(len(t) == 6 for t in out.values())
    assert len({tuple(t) for t in out.values()}) > 1  # the samples differ
    assert bm.num_free_blocks == 64 and set(bm.ref_counts) == {0}


def test_forked_greedy_samples_equal_one_plain_request(tiny_llama_dir):
    """If copy-on-write copied the wrong block or wrote a shared one, the four would diverge."""
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=BS,
                                   enable_prefix_caching=False))
    prompt = list(range(3, 45))
    core.add("one", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    core.add("four", prompt, SamplingParams(temperature=0, n=4, max_tokens=20, ignore_eos=True))
    out = collect(core)
    assert all(out[("four", i)] == out[("one", 0)] for i in range(4))


def test_seeded_n_is_reproducible_and_each_sample_is_its_own_stream(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=10, ignore_eos=True)
    runs = []
    for others in (0, 5):
        core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=128, block_size=BS))
        for k in range(others):
            core.add(f"o{k}", list(range(5 + k, 30)),
                     SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
        core.add("s", list(range(3, 25)), params)
        runs.append({k: v for k, v in collect(core).items() if k[0] == "s"})
    assert runs[0] == runs[1] and len({tuple(v) for v in runs[0].values()}) == 3


def logprob_sum(out: RequestOutput) -> float:
    assert out.logprobs is not None  # the request asked for logprobs
    return sum(lp for lp, _ in out.logprobs)


def test_best_of_returns_the_n_most_likely_at_the_end(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=128, block_size=BS))
    core.add("b", list(range(3, 25)),
             SamplingParams(temperature=1.0, seed=2, n=2, best_of=5, max_tokens=8, ignore_eos=True,
                            logprobs=0))
    rows: list[RequestOutput] = []
    while core.has_work():
        rows += request_outputs(core.step())
    # nothing streamed before the end
    assert [(o.index, o.finished) for o in rows] == [(0, False), (1, True)]
    sums = [logprob_sum(o) for o in rows]
    group = core.scheduler.running  # all gone
    assert not group
    assert sums[0] >= sums[1] and all(len(o.new_token_ids) == 8 for o in rows)


@pytest.mark.parametrize("n", [1, 3])
def test_prompt_of_one_token_forks_at_once(tiny_llama_dir, n):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=16, block_size=BS))
    core.add("x", [7], SamplingParams(temperature=0, n=n, max_tokens=4, ignore_eos=True))
    out = collect(core)
    assert len(out) == n and len({tuple(v) for v in out.values()}) == 1
    assert core.block_manager.num_free_blocks == 16


def test_offline_api_returns_each_sequence_by_index(tiny_llama_dir):
    from engine.offline import LLM

    params = SamplingParams(temperature=0.8, seed=9, n=3, max_tokens=5, ignore_eos=True)
    prompt = [3, 4, 5, 6, 7]
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=BS))
    core.add("a", prompt, params)
    expected = collect(core)
    [out] = LLM(str(tiny_llama_dir), num_blocks=64,
                block_size=BS).generate([prompt], params, use_tqdm=False)
    assert [s.index for s in out.outputs] == [0, 1, 2]
    assert [s.token_ids for s in out.outputs] == [expected[("a", i)] for i in range(3)]
    assert all(s.finish_reason == "length"
               for s in out.outputs) and out.token_ids == out.outputs[0].token_ids


def test_a_choice_ended_by_a_stop_string_frees_its_blocks_and_leaves_the_others_unchanged(
        tiny_llama_dir):
    """The gateway finds stop strings; ABORT with an index ends that one sequence in the engine."""
    params = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=12, ignore_eos=True)
    # 37 tokens: each sample's own partial block from the first decode on
    prompt = list(range(3, 40))
    plain = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=4,
                                    enable_prefix_caching=False))
    plain.add("r", prompt, params)
    want = collect(plain)

    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=4,
                                   enable_prefix_caching=False))
    bm = core.block_manager
    core.add("r", prompt, params)
    core.add("solo", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    got: dict[tuple[str, int], list[int]] = {}
    rows: list[RequestOutput] = []
    for _ in range(6):
        rows += request_outputs(core.step())
    free = bm.num_free_blocks
    stopped = request_outputs(core.stop_choice("r", 1))
    assert [(o.request_id, o.index, o.new_token_ids, o.finished, o.finish_reason)
            for o in stopped] == [
        ("r", 1, [], False, "stop")]
    assert bm.num_free_blocks > free  # its own blocks went back at once
    assert core.stop_choice("r", 1) == []
    assert core.stop_choice("r", 7) == []
    assert core.stop_choice("solo", 0) == []
    for _ in range(2):
        rows += request_outputs(core.step())
    rows += request_outputs(core.stop_choice("r", 0))  # the root sequence may end first too
    while core.has_work():
        rows += request_outputs(core.step())
    for o in rows:
        got.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    assert got[("r", 2)] == want[("r", 2)]  # the others are exactly what they would have been
    for i in (0, 1):
        assert got[("r", i)] == want[("r", i)][:len(got[("r", i)])] and len(got[("r", i)]) < 12
    last = [o for o in rows if o.request_id == "r"][-1]
    assert (last.index, last.finished, last.finish_reason) == (2, True, "length")
    assert "r" not in core.requests and bm.num_free_blocks == 64


def test_stopping_the_last_running_choice_ends_the_request(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=4))
    core.add("r", list(range(3, 20)),
             SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert [(o.index, o.finished)
            for o in request_outputs(core.stop_choice("r", 0))] == [(0, False)]
    last = request_outputs(core.stop_choice("r", 1))
    assert [(o.index, o.finished, o.finish_reason) for o in last] == [(1, True, "stop")]
    events = last[0].events
    assert events is not None and "finished" in events and not core.has_work()
    assert core.block_manager.num_free_blocks == 64 and core.abort(["r"]) == []


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_choice_stopped_while_preempted_frees_every_block(tiny_llama_dir, mode):
    """A stop string found while that sequence sits swapped out (or waiting to recompute)."""
    core = EngineCore(build_config(str(tiny_llama_dir), block_size=4, num_blocks=14,
                                   num_cpu_blocks=64, preemption_mode=mode,
                                   enable_prefix_caching=False))
    for r in ("a", "b"):
        core.add(r, list(range(3, 12)),
                 SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=24, ignore_eos=True))
    stopped = None
    while core.has_work() and stopped is None:
        core.step()
        queue = core.scheduler.swapped if mode == "swap" else core.scheduler.waiting
        stopped = next((s for s in queue if s.group is not None and s.group.forked), None)
    assert stopped is not None, "the pool must be small enough to preempt a forked sequence"
    rows = request_outputs(core.stop_choice(stopped.request.request_id, stopped.index))
    assert [(o.index, o.finish_reason) for o in rows] == [(stopped.index, "stop")]
    assert stopped not in core.scheduler.swapped and stopped not in core.scheduler.waiting
    while core.has_work():
        rows += request_outputs(core.step())
    assert not core.requests
    assert core.block_manager.num_free_blocks == 14 and core.block_manager.cpu.num_free == 64
