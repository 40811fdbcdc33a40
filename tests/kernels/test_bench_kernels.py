"""bench/kernels.py: says so and exits 0 without a GPU; its whole path runs (tiny, interpreted) on
CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_bench_without_gpu_exits_zero_with_a_message() -> None:
    done = _run()
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU" in done.stdout


@pytest.mark.slow
def test_bench_smoke_run_on_cpu() -> None:
    """--smoke: every case of the script on tiny shapes under the interpreter (timings
    meaningless)."""
    done = _run("--smoke")
    assert done.returncode == 0, done.stderr
    for part in ("measured copy bandwidth", "decode", "prefill", "store K/V", "copy_blocks"):
        assert part in done.stdout, done.stdout
