"""One workload for tensor-parallel equality: a shared long prefix (prefix-cache hits), prompts
longer than the step budget (chunked prefill), n > 1 with seeded sampling, beam search, and, under a
small pool, preemption by swap and by recompute."""
from __future__ import annotations

import random

from engine.core import EngineCore
from shared.sampling import SamplingParams

BLOCK = 8
Outputs = dict[tuple[str, int], list[int]]


def workload(vocab: int = 512, seed: int = 1) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(40)]
    reqs = []
    for i in range(8):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 20))]
        prompt = prefix + tail if i % 2 == 0 else tail + [rng.randrange(3, vocab)
                                                          for _ in range(30)]
        kind = i % 4
        if kind == 1:
            params = SamplingParams(n=2, temperature=0.8, seed=100 + i, max_tokens=10,
                                    ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=8,
                                    ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def run(core: EngineCore, reqs: list[tuple[str, list[int], SamplingParams]]) -> Outputs:
    """Half the requests, a few steps (so their prefix blocks are computed and cached), then the
    rest. -> (request id, choice index) -> its tokens."""
    out: Outputs = {}
    half = len(reqs) // 2
    for rid, prompt, params in reqs[:half]:
        core.add(rid, prompt, params)
    steps = 0
    while core.has_work() or steps <= 4:
        if steps == 4:
            for rid, prompt, params in reqs[half:]:
                core.add(rid, prompt, params)
        for o in core.step():
            assert not hasattr(o, "message"), o
            out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        steps += 1
    return out


def assert_all_free(core: EngineCore) -> None:
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.cpu.num_free == bm.cpu.num_blocks
    assert set(bm.ref_counts) == {0} and set(bm.cpu.ref_counts) <= {0}
    assert not core.requests
