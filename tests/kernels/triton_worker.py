"""Run kernel test bodies in a separate worker process, so that a crash fails one test, not the
suite.

Under TRITON_INTERPRET=1 an out-of-bounds unmasked load segfaults the whole Python process. Each
test hands its body (a module-level function and keyword arguments) to a long-lived spawned
worker; when the worker dies, that test fails with the signal and the next test starts a fresh
worker. Reusing the worker saves the 2-3 s that importing torch and triton costs per process.

Two pools: interpret=True sets TRITON_INTERPRET=1 before anything imports a kernel module;
interpret=False clears it (the sm_90 compile test needs the real compiler).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest

_workers: dict[bool, tuple[mp.process.BaseProcess, Connection]] = {}


def _serve(conn: Connection, interpret: bool) -> None:
    """The worker's loop: one job at a time, its outcome sent back as (kind, text)."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    while True:
        try:
            fn, kwargs = conn.recv()
        except EOFError:
            return
        try:
            fn(**kwargs)
            conn.send(("ok", ""))
        except BaseException as e:  # pytest.skip/fail raise BaseException subclasses too
            kind = "skip" if type(e).__name__ == "Skipped" else "fail"
            conn.send((kind, str(e) if kind == "skip" else traceback.format_exc()))


def _worker(interpret: bool) -> tuple[mp.process.BaseProcess, Connection]:
    worker = _workers.get(interpret)
    if worker is None or not worker[0].is_alive():
        parent, child = mp.get_context("spawn").Pipe()
        # daemon: the interpreter's exit hooks end it instead of waiting for it.
        proc = mp.get_context("spawn").Process(target=_serve, args=(child, interpret), daemon=True)
        proc.start()
        child.close()
        conn = parent
        _workers[interpret] = (proc, conn)
    return _workers[interpret]


def _drop(interpret: bool) -> None:
    proc, conn = _workers.pop(interpret)
    conn.close()
    if proc.is_alive():
        proc.kill()
    proc.join()


def run_isolated(fn: Callable[..., None], *, interpret: bool = True, timeout: float = 300,
                 **kwargs: Any) -> None:
    """Run fn(**kwargs) in the worker; raise its failure (or skip) here. fn must be a module-level
    function of an importable module (it travels by name), kwargs must pickle."""
    proc, conn = _worker(interpret)
    conn.send((fn, kwargs))
    try:
        ready = conn.poll(timeout)
        outcome = conn.recv() if ready else None
    except (EOFError, ConnectionResetError):
        outcome = "died"
    if outcome is None:
        _drop(interpret)
        pytest.fail(f"{fn.__name__} did not finish within {timeout} s; the worker was killed",
                    pytrace=False)
    if outcome == "died":
        proc.join(10)
        code = proc.exitcode
        _drop(interpret)
        why = (f"signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        pytest.fail(f"{fn.__name__} crashed the worker process ({why}; an out-of-bounds load?)",
                    pytrace=False)
    kind, text = outcome
    if kind == "skip":
        pytest.skip(text)
    if kind == "fail":
        pytest.fail(f"in the worker process:\n{text}", pytrace=False)
