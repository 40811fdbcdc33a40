"""Mistakes found before the model loads, each a one-line error and a non-zero exit (never a
traceback after a model load): a --trace-file that cannot be written and a port already in use.
And a trace that cannot be written at shutdown still lets the engine close (its ipc socket file
is removed)."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.servers import CONVEYOR, ROOT, Server, children, cmdline, engine_stats, free_port

pytestmark = pytest.mark.slow


def refused(argv: list[str]) -> str:
    """Runs argv to its end -> its stderr, asserting it failed with one line and loaded nothing."""
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "loaded" not in proc.stderr and "engine ready" not in proc.stderr
    return lines[0]


def test_an_unwritable_trace_file_is_refused_before_the_model_loads(tiny_llama_dir: Path,
                                                                    tmp_path: Path) -> None:
    bad = str(tmp_path / "missing" / "trace.json")
    line = refused([CONVEYOR, "serve", "--model", str(tiny_llama_dir), "--port", str(free_port()),
                    "--trace-file", bad, "--log-level", "info"])
    assert "--trace-file" in line and bad in line, line
    line = refused([sys.executable, "-m", "engine", "--address", f"ipc://{tmp_path}/e.sock",
                    "--model", str(tiny_llama_dir), "--trace-file", bad])
    assert "--trace-file" in line and bad in line, line


def test_a_port_in_use_is_refused_before_the_model_loads(tiny_llama_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused([CONVEYOR, "serve", "--model", str(tiny_llama_dir), "--host", "127.0.0.1",
                        "--port", str(port), "--log-level", "info"])
    assert f"127.0.0.1:{port}" in line and "in use" in line, line


def test_a_trace_that_cannot_be_written_at_shutdown_still_closes_the_engine(tiny_llama_dir: Path,
                                                                          tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    sock = tmp_path / "engine.sock"
    argv = [sys.executable, "-m", "engine", "--address", f"ipc://{sock}", "--model",
            str(tiny_llama_dir), "--num-threads", "1", "--kv-cache-memory", "16MiB", "--trace-file",
            str(folder / "t.json")]
    log = tmp_path / "engine.log"
    with Server(argv, exact_argv=True, health_path=None, log_path=log) as server:
        asyncio.run(engine_stats(f"ipc://{sock}"))  # it serves
        shutil.rmtree(folder)  # the trace's folder goes away while it serves
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + 10
    while sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sock.exists(), "close() was skipped: the ipc socket file is still there"
    text = log.read_text()
    assert "the trace could not be written" in text and "Traceback" not in text, text[-3000:]


def test_ctrl_c_while_the_engine_loads_ends_quietly(tiny_chat_model: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group) while the engine child loads: exit 130 without an
    unretrieved EngineDead from the abandoned handshake."""
    log = tmp_path / "server.log"
    server = Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                     "--kv-cache-memory", "32MiB"], log_path=log)
    server.start()
    try:
        deadline = time.monotonic() + 60
        while not any(cmdline(p)[1:3] == ["-m", "engine"] for p in children(server.pid)):
            assert time.monotonic() < deadline
            assert server.proc is not None
            assert server.proc.poll() is None
            time.sleep(0.01)
        os.killpg(server.pid, signal.SIGINT)
        assert server.proc is not None
        assert server.proc.wait(60) == 130, log.read_text()[-3000:]
    finally:
        server.stop()
    text = log.read_text()
    assert "never retrieved" not in text and "EngineDead" not in text, text[-3000:]
