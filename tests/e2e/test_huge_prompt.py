"""A huge prompt must not stall the other streams of a gateway: text longer than the context can
hold is refused before it is tokenized (--max-prompt-chars, by default max_model_len x the longest
token), and what is tokenized is tokenized off the event loop. Measured as the longest gap between
the events of another stream while the huge requests are answered (a correctness bound, not a
speed figure)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.servers import Server

pytestmark = pytest.mark.slow
STALL = 0.5  # seconds: the longest gap another stream may see


async def stream_times(session: aiohttp.ClientSession, url: str, times: list[float]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                times.append(time.monotonic())


async def refused(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> str:
    async with session.post(url + path, json=body) as resp:
        answer = await resp.json()
        assert resp.status == 400, answer
        return str(answer["error"]["message"])


def test_a_huge_prompt_does_not_stall_another_stream(tiny_chat_model: Path, tmp_path: Path) -> None:
    argv = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--kv-cache-memory",
            "32MiB"]
    with Server(argv, log_path=tmp_path / "server.log") as server:
        async def main() -> None:
            huge = "The quick brown fox jumps over the lazy dog. " * (15 * 2**20 // 45)  # 15 MiB
            # within the limit, past the context
            long = "The quick brown fox jumps over the lazy dog. " * 1500
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
                times: list[float] = []
                other = asyncio.create_task(stream_times(session, server.url, times))
                while len(times) < 5:
                    assert not other.done(), other
                    await asyncio.sleep(0.01)
                start = time.monotonic()
                assert "characters" in await refused(session, server.url, "/v1/completions",
                                                     {"prompt": huge})
                chat = {"messages": [{"role": "user", "content": huge[: 7 * 2**19]}]}  # 3.5 MiB
                assert "characters" in await refused(session, server.url, "/v1/chat/completions",
                                                     chat)
                assert "characters" in await refused(session, server.url, "/tokenize",
                                                     {"prompt": huge})
                message = await refused(session, server.url, "/v1/completions", {"prompt": long})
                # tokenized (off the loop), then too long for the context
                assert "characters" not in message
                end = time.monotonic()
                await other
            end = min(end, times[-1])  # after its last event the other stream is done, not stalled
            during = [t for t in times if start <= t <= end]
            assert during, "the other stream sent nothing while the huge requests ran"
            window = [start, *during, end]
            gap = max(b - a for a, b in zip(window, window[1:]))
            assert gap < STALL, f"another stream stalled {gap:.2f}s"

        asyncio.run(asyncio.wait_for(main(), 300))
