"""The engine child process: READY, clean stop, no orphans; and `conveyor gateway` as a real
process."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.launcher import EngineProcess, keep_off_engine_cpus
from shared.client import AsyncEngineClient
from shared.errors import EngineDead
from tests.fakes import FakeEngine, cache_root, smollm2_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# A stand-in for `python -m engine`: the fake engine on the given address until SIGTERM.
FAKE_ENGINE = (f"import signal, sys, threading; sys.path.insert(0, {str(ROOT)!r}); from "
               "tests.fakes import FakeEngine; e = "
               "FakeEngine(address=sys.argv[sys.argv.index('--address') + 1]).__enter__(); "
               "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); threading.Event().wait()")


def fake_engine_process(tmp_path: Path, code: str = FAKE_ENGINE,
                        stop_timeout: float = 10.0) -> EngineProcess:
    proc = EngineProcess(f"ipc://{tmp_path}/engine.sock", [], stop_timeout)
    proc.argv = [sys.executable, "-c", code, "--address", proc.address]
    return proc


def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_start_ready_stop_removes_ipc_file(tmp_path: Path) -> None:
    engine = fake_engine_process(tmp_path)

    async def main() -> None:
        engine.start()
        client = AsyncEngineClient(engine.address)
        await engine.wait_ready(client, timeout=20)
        assert client.ready is not None and client.ready.model_name == "SmolLM2-135M-Instruct"
        await client.close()

    try:
        asyncio.run(main())
        assert (tmp_path / "engine.sock").exists()
    finally:
        engine.stop()
    assert engine.exit_code() == 0 and not (tmp_path / "engine.sock").exists()


def test_engine_that_dies_while_loading_fails_fast(tmp_path: Path) -> None:
    engine = fake_engine_process(tmp_path, "import sys; sys.exit(3)")

    async def main() -> None:
        engine.start()
        client = AsyncEngineClient(engine.address)
        start = time.monotonic()
        with pytest.raises(EngineDead, match="exited with code 3"):
            await engine.wait_ready(client, timeout=60)
        assert time.monotonic() - start < 10
        await client.close()

    asyncio.run(main())


def test_engine_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    armed = tmp_path / "armed"  # written once SIGTERM is ignored: one before that would end it
    ignore_sigterm = ("import pathlib, signal, time; "
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      f"pathlib.Path({str(armed)!r}).touch(); time.sleep(60)")
    engine = fake_engine_process(tmp_path, ignore_sigterm, stop_timeout=0.5)
    engine.start()
    deadline = time.monotonic() + 60
    while not armed.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert armed.exists()
    engine.stop()
    assert engine.exit_code() == -signal.SIGKILL


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_engine_dies_with_a_killed_parent(tmp_path: Path) -> None:
    """SIGKILL gives the gateway no chance to clean up; the kernel still takes the engine down."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from gateway.launcher import EngineProcess, keep_off_engine_cpus; "
         "p = EngineProcess('ipc://x', []); p.argv = [sys.executable, '-c', 'import time; "
         "time.sleep(60)']; "
         "p.start(); print(p.proc.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, cwd=ROOT)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert gone(child), "the engine outlived its gateway"


@pytest.mark.slow
def test_gateway_command_serves_and_stops_on_sigterm() -> None:
    smollm2_tokenizer()  # parse the GGUF here once, so the subprocess finds the tokenizer cached
    env = {**os.environ, "CONVEYOR_CACHE": str(cache_root())}
    with FakeEngine() as eng:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "gateway", "--engine-address",
                                 eng.address, "--port", str(_free_port())], cwd=ROOT, env=env,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert "serving SmolLM2-135M-Instruct on http://127.0.0.1:" in line, line
            url = line.split(" on ")[1].strip()
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                assert resp.status == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
        finally:
            proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_gateway_processes_move_off_the_cores_the_engine_is_bound_to() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    engine, gateway = subprocess.Popen(sleep), subprocess.Popen(sleep)
    try:
        # an engine on every core: nothing moves
        assert keep_off_engine_cpus(engine.pid, [gateway.pid]) is None
        assert os.sched_getaffinity(gateway.pid) == set(cpus)
        os.sched_setaffinity(engine.pid, {cpus[0]})  # as OpenMP binds a one-thread engine
        assert keep_off_engine_cpus(engine.pid, [gateway.pid]) == set(cpus[1:])
        assert os.sched_getaffinity(gateway.pid) == set(cpus[1:])
        assert os.sched_getaffinity(engine.pid) == {cpus[0]}
    finally:
        for proc in (engine, gateway):
            proc.kill()
            proc.wait()


def test_gateway_workers_get_the_chat_flags() -> None:
    """--gateway-workers: every worker parses chat requests as `serve` was told (template,
    parsers)."""
    from gateway.cli import build_parser, worker_argv

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--chat-template", "/t.jinja",
                              "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                              "--gateway-workers", "2"])
    worker = parser.parse_args(worker_argv(args, "ipc:///tmp/x")[3:])
    got = (worker.chat_template, worker.tool_call_parser, worker.reasoning_parser)
    assert got == ("/t.jinja", "hermes", "qwen3")
