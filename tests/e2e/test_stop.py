"""Ctrl-C on a serving `conveyor serve` stops it quietly: the gateway stops its engine child in
order and exits only once the engine has, so a --trace-file is complete when the gateway is gone."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.servers import Server, alive, children, cmdline, tiny_serve

pytestmark = pytest.mark.slow


def test_ctrl_c_stops_gateway_and_engine_quietly_and_writes_the_trace(tiny_chat_model: Path,
                                                                       tmp_path: Path) -> None:
    log, trace = tmp_path / "server.log", tmp_path / "trace.json"
    server = Server(tiny_serve(tiny_chat_model, "--trace-file", str(trace)), log_path=log)
    try:
        with server:
            assert complete(server.url, "hello") == 200  # a request, so the trace has one to show
            engine = next(p for p in children(server.pid) if cmdline(p)[1:3] == ["-m", "engine"])
            os.killpg(server.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
            assert server.proc is not None
            deadline = time.monotonic() + 120
            while (server.proc.poll() is None or alive(engine)) and time.monotonic() < deadline:
                time.sleep(0.05)
                assert server.proc.poll() is None or not alive(engine), (
                    "the gateway exited before its engine")
            assert server.proc.poll() == 0, log.read_text()[-3000:]
            assert not alive(engine)
    finally:
        server.stop()
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["name"].startswith("request ") for e in events), events[:5]


def complete(url: str, prompt: str) -> int:
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return int(resp.status)
