"""Data-parallel replicas that die or come and go while serving: a SIGKILLed replica's streams resume at
once on the live one (text identical to an uninterrupted run, float32 greedy, one usage block, no error
event) while new requests keep being served, and `--max-engine-restarts 0` leaves the gateway serving
on the replica that is left."""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from tests.distributed.test_rank_death import Stream, sse
from tests.e2e.servers import Server, alive, children, cmdline, engine_stats, wait_engine_idle

pytestmark = pytest.mark.slow
# Longer than the router's affinity prefix (32 tokens): the four streams land on one replica.
PREFIX = ("You are a careful assistant. Answer in one short sentence, cite nothing, and never repeat the "
          "question back. The user's documents follow, each on its own line. ")
PROMPTS = [PREFIX + t for t in ("The quick brown fox", "Once upon a time", "In the beginning", "Numbers: 1, 2,")]


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


async def run(url: str, kill: Callable[[], int] | None, during: list[str]) -> tuple[list[Stream], list[str]]:
    """The four streams at once; with kill, SIGKILL what it names once each is mid-decode, then serve the
    `during` prompts as new requests while the streams move."""
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


def test_a_dead_replicas_streams_resume_on_the_live_one(tiny_chat_model: Path, tmp_path: Path,
                                                        tiny_offline: Callable[[list[str], int], list[str]]) -> None:
    with Server(["serve", "--model", str(tiny_chat_model), "-dp", "2", "--max-engine-restarts", "0",
                 "--dtype", "float32", "--kv-cache-memory", "32MiB", "--log-level", "warning"],
                log_path=tmp_path / "server.log") as server:
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
            assert [g.usages[0][k] for k in ("prompt_tokens", "completion_tokens")] == \
                [w.usages[0][k] for k in ("prompt_tokens", "completion_tokens")]
        assert texts == tiny_offline(during, 8)
        assert server.proc is not None and server.proc.poll() is None, "one replica left must keep serving"
        [live] = [a for a in addresses if a != lost[0]]
        assert not any(alive(p) and lost[0] in cmdline(p) for p in children(server.pid))
        stats = asyncio.run(wait_engine_idle(live, timeout=30))
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
        assert "engine_out_of_service" in server.log()
