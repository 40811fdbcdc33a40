"""bench/triton_tune.py: says so and exits 0 without a GPU; its whole path runs (tiny, interpreted)
on CPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TUNE = Path(__file__).resolve().parents[2] / "bench" / "triton_tune.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(TUNE), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_tune_without_gpu_exits_zero_with_a_message() -> None:
    done = _run("--quick")
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU" in done.stdout


@pytest.mark.slow
def test_tune_smoke_run_on_cpu() -> None:
    """--smoke: the current config, SDPA and one grid config checked and timed under the
    interpreter."""
    done = _run("--smoke")
    assert done.returncode == 0, done.stderr
    for part in ("current", "SDPA", "best:", "done in"):
        assert part in done.stdout, done.stdout
    assert "REJECTED" not in done.stdout, done.stdout
