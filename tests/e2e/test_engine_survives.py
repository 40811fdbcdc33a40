"""Issue #14's three requests that once stopped the whole server, against a real `conveyor serve`:
each is answered (400, or it completes), the server then serves a normal request, nothing is left
running or holding a block, and the stalled-step watchdog stays at 0."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.metrics import parse
from tests.e2e.servers import Server, is_idle, wait_engine_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("survives") / "server.log"
    # 24 blocks of 8: one request's four beams fit even unshared (4 x 6 blocks of 48
    # tokens), three do not.
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--num-blocks",
                 "24", "--block-size", "8", "--swap-space", "0", "--no-prefix-caching",
                 "--log-level", "info"], log_path=log) as srv:
        yield srv


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


def test_the_requests_that_once_stopped_the_engine_are_answered_and_it_keeps_serving(
        server: Server) -> None:
    async def main() -> dict[str, float]:
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, server.url,
                                      {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [100000]})
            assert status == 400 and "stop_token_ids" in body["error"]["message"], body
            for penalty in (1000, -1000):  # overflowed, or divided by zero, in beam scoring
                status, body = await post(s, server.url,
                                          {"prompt": "hi", "use_beam_search": True,
                                           "length_penalty": penalty, "max_tokens": 16})
                assert status in (200, 400), body
                assert status == 200 or "length_penalty" in body["error"]["message"], body
            # Three beam searches that cannot share the pool: before, one beam swapped out
            # alone could never come back while its siblings held their blocks, and every step
            # after was empty.
            beams = [{"prompt": list(range(300 + 40 * i, 335 + 40 * i)), "use_beam_search": True,
                      "beam_width": 4, "n": 2, "max_tokens": 12, "ignore_eos": True}
                     for i in range(3)]
            for status, body in await asyncio.gather(*(post(s, server.url, b) for b in beams)):
                assert status == 200 and len(body["choices"]) == 2, body
            status, body = await post(s, server.url,
                                      {"prompt": "Hello", "max_tokens": 5, "temperature": 0})
            assert status == 200 and body["usage"]["completion_tokens"] == 5
            async with s.get(f"{server.url}/metrics") as resp:
                metrics = parse(await resp.text())
        assert metrics["conveyor_engine_stalled_steps_total"] == 0
        assert metrics["conveyor_num_preemptions_total"] > 0  # the pool really was under pressure
        return await wait_engine_idle(server.engine_address)

    stats = asyncio.run(asyncio.wait_for(main(), 180))
    assert is_idle(stats) and stats["total_stalled_steps"] == 0
