"""A tensor-parallel rank SIGKILLed while streams decode: the engine exits without answering them
(no collective library's message reaches a client), the supervisor of `conveyor serve` starts a new
engine with all its ranks, and every stream carries on to the text of an uninterrupted run, with one
usage block and no error event. The same through the SDK alone against an engine process (mp and Ray
workers), restarted by hand as an outside supervisor would."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from shared.client import AsyncEngineClient
from shared.sampling import SamplingParams
from tests.e2e.servers import Server, alive, children, cmdline

pytestmark = pytest.mark.slow
MAX_TOKENS = 400  # a step takes milliseconds: every stream is mid-decode at the kill
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "Numbers: 1, 2, 3,"]


class Stream:
    """One SSE stream as it arrives: text so far, usage blocks, error events, [DONE]."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.usages: list[dict[str, Any]] = []
        self.errors: list[Any] = []
        self.done = False


async def sse(session: aiohttp.ClientSession, url: str, prompt: str, out: Stream) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                out.done = True
            elif line.startswith(b"data: "):
                obj = orjson.loads(line[6:])
                if "error" in obj:
                    out.errors.append(obj["error"])
                    continue
                if obj.get("usage"):
                    out.usages.append(obj["usage"])
                out.text += [c["text"] for c in obj["choices"]]


async def streams_with_kill(url: str, victim: Any) -> list[Stream]:
    """Every prompt streams at once; with victim (a callable -> pid), SIGKILL it mid-decode."""
    streams = [Stream() for _ in PROMPTS]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [asyncio.create_task(sse(session, url, p, s)) for p, s in zip(PROMPTS, streams)]
        if victim is not None:
            while not all(len(s.text) >= 5 for s in streams):
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.005)
            os.kill(victim(), signal.SIGKILL)
        await asyncio.gather(*tasks)
    return streams


def tp_workers(engine_pid: int) -> list[int]:
    return [p for p in children(engine_pid) if "engine.distributed.worker" in " ".join(cmdline(p))]


def engine_pids(server: Server) -> list[int]:
    return [p for p in children(server.pid) if cmdline(p)[1:3] == ["-m", "engine"]]


def assert_resumed(got: list[Stream], want: list[Stream]) -> None:
    for g, w in zip(got, want):
        assert g.errors == [] and g.done, (g.errors, "".join(g.text)[-200:])
        assert "".join(g.text) == "".join(w.text)
        assert len(g.usages) == 1 and g.usages[0]["completion_tokens"] == MAX_TOKENS, g.usages


def test_streams_survive_a_killed_tp_worker(tiny_chat_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with Server(
        [
            "serve",
            "--model",
            str(tiny_chat_model),
            "-tp",
            "2",
            "--num-threads",
            "1",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "32MiB",
            "--swap-space",
            "16MiB",
            "--collective-timeout",
            "120",
            "--log-level",
            "warning",
        ],
        log_path=log,
    ) as server:
        reference = asyncio.run(asyncio.wait_for(streams_with_kill(server.url, None), 300))
        for s in reference:
            assert s.done and not s.errors and len(s.usages) == 1
        [engine] = engine_pids(server)
        [worker] = tp_workers(engine)
        got = asyncio.run(asyncio.wait_for(streams_with_kill(server.url, lambda: worker), 300))
        assert_resumed(got, reference)
        assert not alive(engine), (
            "the engine must exit with its rank, for the supervisor to restart it"
        )
        [new_engine] = engine_pids(server)
        assert len(tp_workers(new_engine)) == 1
        text = server.log()
        assert "engine_restart" in text and "gloo" not in "".join("".join(s.text) for s in got)


# -- the SDK alone: the engine exits, an outside supervisor (here: the test) starts it again ----
ENGINE_FLAGS = [
    "--tensor-parallel-size",
    "2",
    "--num-threads",
    "1",
    "--dtype",
    "float32",
    "--num-blocks",
    "64",
    "--swap-space",
    "0",
    "--collective-timeout",
    "120",
]


def start_engine(address: str, model: Path, backend: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "--address",
            address,
            "--model",
            str(model),
            *ENGINE_FLAGS,
            "--distributed-executor-backend",
            backend,
        ]
    )


def ray_worker_pids() -> list[int]:
    """Ray actor processes running a tensor-parallel worker (titled ray::_RayWorkerActor...)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and "_RayWorkerActor" in " ".join(cmdline(int(name))):
            pids.append(int(name))
    return pids


def find_worker(engine: subprocess.Popen[bytes], backend: str, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = tp_workers(engine.pid) if backend == "mp" else ray_worker_pids()
        if len(pids) == 1:
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"no single {backend} worker found")


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_sdk_streams_resume_after_a_rank_dies(
    tiny_llama_dir: Path, tmp_path: Path, backend: str
) -> None:
    if backend == "ray":
        pytest.importorskip("ray")
        assert not ray_worker_pids(), (
            "another Ray worker runs on this machine: cannot tell which to kill"
        )
    address = f"ipc://{tmp_path}/tp.sock"
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    engines = [start_engine(address, tiny_llama_dir, backend)]

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        async with AsyncEngineClient(
            address, name="tp-test", ready_timeout=180, resume_timeout=180
        ) as client:
            reference = [
                [t async for o in await client.add(p, params) for t in o.new_token_ids]
                for p in prompts
            ]
            streams = [await client.add(p, params) for p in prompts]
            outs: list[list[int]] = [[] for _ in prompts]
            for s, out in zip(streams, outs):  # every stream has begun
                out += (await s.__anext__()).new_token_ids
            os.kill(find_worker(engines[0], backend), signal.SIGKILL)
            assert (
                await asyncio.to_thread(engines[0].wait, 60) != 0
            )  # the engine ends with its rank
            engines.append(start_engine(address, tiny_llama_dir, backend))
            for s, out in zip(streams, outs):
                async for o in s:
                    out += o.new_token_ids
                assert o.events and o.events.get("resumed") == 1, (
                    o.events
                )  # it was resubmitted, once
            return reference, outs

    try:
        reference, outs = asyncio.run(asyncio.wait_for(main(), 400))
        assert outs == reference
    finally:
        for e in engines:
            e.kill()
            e.wait()
