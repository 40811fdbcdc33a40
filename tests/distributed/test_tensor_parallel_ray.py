"""The TP=2 equality test with the Ray backend: the worker is a Ray actor in a placement group of a
local Ray cluster this test starts (and stops)."""
from __future__ import annotations

import pytest

from tests.distributed.test_tensor_parallel import stop_ray_engine, tp_engine
from tests.distributed.workload import assert_all_free, run, workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_tp2_on_ray_equals_tp1(tiny_llama_dir, local_ray):
    reqs = workload()
    reference = run(tp_engine(tiny_llama_dir, 1, num_blocks=1024, num_cpu_blocks=0), reqs)
    core = tp_engine(tiny_llama_dir, 2, num_blocks=20, num_cpu_blocks=6,
                     distributed_executor_backend="ray")
    try:
        out = run(core, reqs)
        stats = core.stats()
    finally:
        stop_ray_engine(core)
    assert out == reference
    assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0
    assert_all_free(core)
