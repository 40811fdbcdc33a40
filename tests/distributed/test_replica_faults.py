"""Data-parallel replicas that die or come and go while serving: a SIGKILLed replica's streams
resume at once on the live one (text identical to an uninterrupted run, float32 greedy, one
usage block, no error event) while new requests keep being served, and `--max-engine-restarts 0`
leaves the gateway serving on the replica that is left. `conveyor gateway` starts with one of
its two replicas down, admits it when it comes up (it takes traffic), and loses nothing when a
replica goes away."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.metrics import parse
from tests.distributed.test_rank_death import Stream, sse
from tests.e2e.servers import ROOT, Server, alive, children, cmdline, engine_stats, wait_engine_idle

pytestmark = pytest.mark.slow
# Longer than the router's affinity prefix (32 tokens): the four streams land on one replica.
PREFIX = (
    "You are a careful assistant. Answer in one short sentence, cite nothing, and never repeat the "
    "question back. The user's documents follow, each on its own line. "
)
PROMPTS = [
    PREFIX + t
    for t in ("The quick brown fox", "Once upon a time", "In the beginning", "Numbers: 1, 2,")
]


def replica_pid(server: Server, address: str) -> int:
    [pid] = [p for p in children(server.pid) if address in cmdline(p)]
    return pid


async def holder(addresses: list[str]) -> str:
    """The replica whose engine runs the four streams."""
    while True:
        for a in addresses:
            if (await engine_stats(a))["num_running"] == len(PROMPTS):
                return a
        await asyncio.sleep(0.05)


async def complete(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return str((await resp.json())["choices"][0]["text"])


async def run(
    url: str, kill: Callable[[], int] | None, during: list[str]
) -> tuple[list[Stream], list[str]]:
    """The four streams at once; with kill, SIGKILL what it names once each is mid-decode, then
    serve the `during` prompts as new requests while the streams move."""
    streams = [Stream() for _ in PROMPTS]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [asyncio.create_task(sse(session, url, p, s)) for p, s in zip(PROMPTS, streams)]
        texts: list[str] = []
        if kill is not None:
            while not all(len(s.text) >= 5 for s in streams):
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.005)
            os.kill(await asyncio.to_thread(kill), signal.SIGKILL)
            texts = list(await asyncio.gather(*(complete(session, url, p) for p in during)))
        await asyncio.gather(*tasks)
    return streams, texts


def test_a_dead_replicas_streams_resume_on_the_live_one(
    tiny_chat_model: Path, tmp_path: Path, tiny_offline: Callable[[list[str], int], list[str]]
) -> None:
    with Server(
        [
            "serve",
            "--model",
            str(tiny_chat_model),
            "-dp",
            "2",
            "--max-engine-restarts",
            "0",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "32MiB",
            "--log-level",
            "warning",
        ],
        log_path=tmp_path / "server.log",
    ) as server:
        addresses = [f"ipc:///tmp/conveyor-{server.pid}-{i}.sock" for i in range(2)]
        reference, _ = asyncio.run(asyncio.wait_for(run(server.url, None, []), 300))
        during = [f"Question {i}: what is {i} plus {i * 7}?" for i in range(3)]
        lost: list[str] = []

        def kill() -> int:
            lost.append(asyncio.run(holder(addresses)))
            return replica_pid(server, lost[0])

        got, texts = asyncio.run(asyncio.wait_for(run(server.url, kill, during), 300))
        for g, w in zip(got, reference):
            assert g.errors == [] and g.done, g.errors
            assert "".join(g.text) == "".join(w.text)
            assert len(g.usages) == 1
            assert [g.usages[0][k] for k in ("prompt_tokens", "completion_tokens")] == [
                w.usages[0][k] for k in ("prompt_tokens", "completion_tokens")
            ]
        assert texts == tiny_offline(during, 8)
        assert server.proc is not None and server.proc.poll() is None, (
            "one replica left must keep serving"
        )
        [live] = [a for a in addresses if a != lost[0]]
        assert not any(alive(p) and lost[0] in cmdline(p) for p in children(server.pid))
        stats = asyncio.run(wait_engine_idle(live, timeout=30))
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
        assert "engine_out_of_service" in server.log()


def start_engine(address: str, model: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine",
            "--address",
            address,
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--kv-cache-memory",
            "32MiB",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
    )


async def metrics(url: str, name: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        m = parse(await resp.text())
    return {
        k.split("replica=")[1].rstrip("}").strip('"'): v
        for k, v in m.items()
        if k.startswith(name + "{")
    }


async def until(check: Callable[[], Any], timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := await check()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)
    return got


def test_gateway_starts_with_a_replica_down_admits_it_later_and_loses_nothing_when_one_goes(
    tiny_chat_model: Path, tmp_path: Path, tiny_offline: Callable[[list[str], int], list[str]]
) -> None:
    a, b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    engines = {a: start_engine(a, tiny_chat_model)}
    prompts = [f"Question {i}: what is {i} plus {i * 7}?" for i in range(12)]
    expected = tiny_offline(prompts, 8)
    try:
        with Server(
            [
                "gateway",
                "--engine-address",
                f"{a},{b}",
                "--model",
                str(tiny_chat_model),
                "--log-level",
                "warning",
            ],
            log_path=tmp_path / "gateway.log",
        ) as gw:

            async def serve_all() -> list[str]:
                async with aiohttp.ClientSession() as session:
                    return list(
                        await asyncio.gather(*(complete(session, gw.url, p) for p in prompts))
                    )

            assert asyncio.run(serve_all()) == expected  # on A alone
            engines[b] = start_engine(b, tiny_chat_model)
            asyncio.run(until(lambda: _up(gw.url, b)))
            assert asyncio.run(dashboard_hello(gw.url, 1)) == {"index": 1, "addresses": [a, b]}
            before = asyncio.run(metrics(gw.url, "conveyor_replica_requests_routed_total"))
            assert asyncio.run(serve_all()) == expected
            after = asyncio.run(metrics(gw.url, "conveyor_replica_requests_routed_total"))
            assert after[b] > before.get(b, 0) and after[a] > before[a], (
                before,
                after,
            )  # the ring rebalanced
            # B goes away under four streams: they finish on A, identical; new requests
            # keep being served.
            reference, _ = asyncio.run(run(gw.url, None, []))
            lost: list[str] = []

            def kill() -> int:
                lost.append(asyncio.run(holder([a, b])))
                return engines[lost[0]].pid

            got, texts = asyncio.run(asyncio.wait_for(run(gw.url, kill, prompts[:3]), 300))
            for g, w in zip(got, reference):
                assert g.errors == [] and g.done and "".join(g.text) == "".join(w.text)
            assert texts == expected[:3]
            assert asyncio.run(until(lambda: _down(gw.url, lost[0])))
    finally:
        for p in engines.values():
            p.kill()
            p.wait()


async def _up(url: str, address: str) -> bool:
    return (await metrics(url, "conveyor_replica_up")).get(address) == 1


async def _down(url: str, address: str) -> bool:
    return (await metrics(url, "conveyor_replica_up")).get(address) == 0


async def dashboard_hello(url: str, replica: int) -> Any:
    """The dashboard's first message on ?replica=N: which replica it shows, of which (past
    the end: 400)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/dashboard/ws?replica=2") as resp:
            assert resp.status == 400
        async with session.ws_connect(f"{url}/dashboard/ws?replica={replica}") as ws:
            return (await ws.receive_json())["hello"]["replica"]
