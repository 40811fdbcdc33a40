"""`conveyor serve --data-parallel-size 2`: two single-thread engines behind one gateway. A shared
long prefix lands on one replica (the second request hits its cache), unrelated prompts spread
over both, an abort and an n > 1 request reach the replica that holds them, and greedy output
equals one engine's."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from gateway.metrics import parse
from tests.e2e.conftest import stream_completion
from tests.e2e.servers import Server, children, cmdline, engine_stats, wait_engine_idle

pytestmark = pytest.mark.slow
PREFIX = ("You are a careful assistant. Answer in one short sentence, cite nothing, and never "
          "repeat the question back. The user's documents follow, each on its own line, numbered "
          "from one. ") * 2


@pytest.fixture(scope="module")
def dp_server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("dp") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--data-parallel-size", "2", "--dtype",
                 "float32", "--kv-cache-memory", "32MiB", "--log-level", "info"],
                log_path=log) as srv:
        yield srv


def replicas(srv: Server) -> list[str]:
    return [f"ipc:///tmp/conveyor-{srv.pid}-{i}.sock" for i in range(2)]


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, **extra: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def routed(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        m = parse(await resp.text())
    return {k.split("replica=")[1].rstrip("}"): v for k, v in m.items()
            if k.startswith("conveyor_replica_requests_routed_total{")}


def test_two_single_thread_engines_on_their_own_cores(dp_server: Server) -> None:
    engines = [p for p in children(dp_server.pid) if cmdline(p)[1:3] == ["-m", "engine"]]
    assert len(engines) == 2
    argvs = [cmdline(p) for p in engines]
    assert all(a[a.index("--num-threads") + 1] == "1" for a in argvs), argvs
    import os

    cpus = [os.sched_getaffinity(p) for p in engines]
    assert not cpus[0] & cpus[1], cpus


def test_shared_prefix_lands_on_one_replica_and_hits_its_cache(dp_server: Server) -> None:
    async def main() -> tuple[dict, dict, dict[str, float], dict[str, float]]:
        async with aiohttp.ClientSession() as session:
            before = await routed(session, dp_server.url)
            first = await complete(session, dp_server.url, PREFIX + "1. The sky is blue.")
            second = await complete(session, dp_server.url, PREFIX + "2. Grass is green, mostly.")
            return first, second, before, await routed(session, dp_server.url)

    first, second, before, after = asyncio.run(asyncio.wait_for(main(), 60))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    gained = {r: after[r] - before.get(r, 0) for r in after}
    assert sorted(gained.values()) == [0, 2], gained  # both on one replica


def test_unrelated_prompts_spread_and_equal_one_engine(
        dp_server: Server,
        tiny_offline: Callable[[list[str], int], list[str]]) -> None:
    prompts = [f"Question {i}: what is {i} plus {i * 7}?" for i in range(10)]
    expected = tiny_offline(prompts, 8)

    async def main() -> tuple[list[str], dict[str, float], dict[str, float]]:
        async with aiohttp.ClientSession() as session:
            before = await routed(session, dp_server.url)
            texts = await asyncio.gather(*[stream_completion(session, dp_server.url, p, 8)
                                           for p in prompts])
            return list(texts), before, await routed(session, dp_server.url)

    texts, before, after = asyncio.run(asyncio.wait_for(main(), 60))
    assert texts == expected
    gained = [after[r] - before.get(r, 0) for r in sorted(after)]
    assert sum(gained) == len(prompts) and min(gained) > 0, gained


def test_n_and_abort_reach_the_replica_holding_the_request(
        dp_server: Server,
        tiny_offline: Callable[[list[str], int], list[str]]) -> None:
    prompt = "Tell me a long story about a lighthouse keeper"
    expected = tiny_offline([prompt], 6)[0]

    async def main() -> dict:
        async with aiohttp.ClientSession() as session:
            choices = await complete(session, dp_server.url, prompt, n=2, max_tokens=6)
            body = {"prompt": prompt, "max_tokens": LONG, "ignore_eos": True, "stream": True}
            async with session.post(f"{dp_server.url}/v1/completions", json=body) as resp:
                await resp.content.readline()  # the first event: the request runs; then hang up
            return choices

    before = decoded(dp_server)
    out = asyncio.run(asyncio.wait_for(main(), 60))
    assert [c["text"] for c in out["choices"]] == [expected, expected]
    # the abort freed the request where it ran: both replicas idle
    for address in replicas(dp_server):
        stats = asyncio.run(wait_engine_idle(address, timeout=30))
        assert stats["num_running"] == 0, (address, stats)
        assert stats["num_free_blocks"] == stats["num_blocks"], (address, stats)
    assert decoded(dp_server) - before < LONG  # it stopped early: the abort reached its replica


LONG = 900


def decoded(srv: Server) -> float:
    """Tokens decoded by both replicas since they started."""
    return sum(asyncio.run(engine_stats(a))["total_decode_tokens"] for a in replicas(srv))
