"""Memory pressure: many more tokens than the KV pool holds. Preemption (swap and recompute) must
change nothing in the outputs, lose no request, and leave no block held in either pool."""
from __future__ import annotations

import random

import pytest

from engine.core import EngineCore
from shared.config import build_config
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams

NUM_REQUESTS = 100
BLOCK = 8


def workload(seed: int = 0):
    rng = random.Random(seed)
    reqs = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(8, 60))]
        if i % 2:  # seeded sampling must survive preemption too
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i,
                                    max_tokens=rng.randint(4, 24), ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True)
        reqs.append((prompt, params))
    return reqs


def run(folder, reqs, **options):
    core = EngineCore(build_config(str(folder), block_size=BLOCK, max_num_batched_tokens=256,
                                   max_num_seqs=128, **options))
    for i, (prompt, params) in enumerate(reqs):
        core.add(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(reqs))}
    finished = set()
    while core.has_work():
        for o in core.step():
            assert isinstance(o, RequestOutput), o  # an Error here fails the test
            out[o.request_id] += o.new_token_ids
            if o.finished:
                finished.add(o.request_id)
    return core, out, finished


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    reqs = workload()
    core, out, _ = run(tiny_llama_dir, reqs, num_blocks=2048, num_cpu_blocks=0)
    assert core.stats()["num_preemptions_swap"] + core.stats()["num_preemptions_recompute"] == 0
    return reqs, out


@pytest.mark.parametrize("mode,cpu_blocks", [("auto", 6), ("swap", 400), ("recompute", 0)])
def test_outputs_identical_under_memory_pressure(tiny_llama_dir, reference, mode, cpu_blocks):
    reqs, expected = reference
    total_tokens = sum(len(p) + s.max_tokens for p, s in reqs)
    num_blocks = total_tokens // 10 // BLOCK  # the pool holds about 10% of all tokens
    core, out, finished = run(tiny_llama_dir, reqs, num_blocks=num_blocks,
                              num_cpu_blocks=cpu_blocks, preemption_mode=mode)
    assert finished == set(expected)
    assert out == expected
    stats = core.stats()
    swaps, recomputes = stats["num_preemptions_swap"], stats["num_preemptions_recompute"]
    if mode == "auto":
        assert swaps > 0 and recomputes > 0
    elif mode == "swap":
        assert swaps > 0 and recomputes == 0
    else:
        assert recomputes > 0 and swaps == 0
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.cpu.num_free == bm.cpu.num_blocks
    assert set(bm.ref_counts) == {0} and set(bm.cpu.ref_counts) <= {0}
    assert not core.requests


def test_swapped_request_resumes_into_other_blocks(tiny_llama_dir):
    """A swapped request comes back into whatever device blocks are free, not necessarily its old
    ones."""
    core = EngineCore(build_config(str(tiny_llama_dir), block_size=BLOCK, num_blocks=12,
                                   num_cpu_blocks=64, preemption_mode="swap"))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        core.add(f"r{i}", list(range(3 + i, 20 + i)), params)
    tables: dict[str, set[tuple[int, ...]]] = {f"r{i}": set() for i in range(3)}
    while core.has_work():
        core.step()
        for rid, live in core.requests.items():
            if not live.root.swapped and live.root.block_table:
                tables[rid].add(tuple(live.root.block_table[:3]))
    assert core.stats()["num_preemptions_swap"] > 0
    assert any(len(t) > 1 for t in tables.values()), \
        "some request must have resumed into different blocks"
