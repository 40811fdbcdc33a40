"""Tensor parallelism with local worker processes: greedy (and seeded) float32 output equal to TP=1
token for token through chunked prefill, prefix caching, swap and recompute preemption, n > 1 and
beam search; every block free at the end, every worker still in step (it takes STOP and exits 0)."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from engine.core import EngineCore
from engine.step import EngineFault
from shared.config import build_config
from shared.sampling import SamplingParams
from tests.distributed.workload import BLOCK, assert_all_free, run, workload

COMMON = dict(dtype="float32", num_threads=1, block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=16)


def tp_engine(folder, tp: int, **options) -> EngineCore:
    return EngineCore(build_config(str(folder), tensor_parallel_size=tp, **{**COMMON, **options}))


def stop(core: EngineCore) -> list[int]:
    """Closes the engine; -> each worker's exit code (0: it took STOP, so it had followed every step)."""
    core.close()
    return [w.proc.returncode for w in core.runner.workers]  # type: ignore[attr-defined]


def stop_ray_engine(core: EngineCore) -> None:
    """Closes an engine whose workers are Ray actors; asserts each ended by STOP (returned 0)."""
    import ray

    core.close()
    assert [ray.get(w.done, timeout=30) for w in core.runner.workers] == [0]  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tp2_equals_tp1_under_preemption(checkpoint, request):
    folder = request.getfixturevalue(checkpoint)
    reqs = workload()
    reference = run(tp_engine(folder, 1, num_blocks=1024, num_cpu_blocks=0), reqs)
    core = tp_engine(folder, 2, num_blocks=20, num_cpu_blocks=6, preemption_mode="auto")
    try:
        out = run(core, reqs)
        stats = core.stats()
    finally:
        codes = stop(core)
    assert out == reference
    assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0
    assert stats["total_prefix_hits_tokens"] > 0
    assert_all_free(core)
    assert codes == [0]


def test_heads_that_do_not_divide_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*heads.*sizes that do: 1, 2"):
        tp_engine(tiny_llama_dir, 3)


@pytest.mark.slow
def test_killed_worker_fails_the_engine_within_the_collective_timeout(tiny_llama_dir):
    """SIGKILL a worker while requests are running: the next step raises EngineFault (no hang); the
    loop then ends every request with an error and exits (engine/loop.py)."""
    core = tp_engine(tiny_llama_dir, 2, num_blocks=64, collective_timeout=10)
    outcome: list[BaseException | None] = []
    try:
        core.add("long", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        core.step()
        os.kill(core.runner.workers[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]

        def step_until_failure() -> None:
            try:
                while core.has_work():
                    core.step()
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - the outcome is what the test asserts
                outcome.append(e)

        t = threading.Thread(target=step_until_failure, daemon=True)
        t.start()
        t.join(timeout=60)  # generous: the collective timeout is 10 s, a dead peer is seen at once
        assert not t.is_alive(), "the engine hung on a dead worker"
        assert isinstance(outcome[0], EngineFault) and "rank 1 exited" in str(outcome[0]), outcome
    finally:
        stop(core)


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(smollm2_source):
    """SmolLM2 has 9 query and 3 K/V heads: 3 is its only split. Short prompts, few tokens."""
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_source)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):\n    ")]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reqs = [(f"s{i}", p, params) for i, p in enumerate(prompts)]
    reference = run(tp_engine(smollm2_source.name, 1, num_blocks=64, num_cpu_blocks=0, max_num_batched_tokens=8),
                    reqs)
    core = tp_engine(smollm2_source.name, 3, num_blocks=64, num_cpu_blocks=0, max_num_batched_tokens=8)
    try:
        out = run(core, reqs)
    finally:
        codes = stop(core)
    assert out == reference
    assert_all_free(core)
    assert codes == [0, 0]
