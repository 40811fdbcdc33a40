"""Connections that never finish a request cannot hold a real `conveyor serve`: 1,000 half-sent
headers are closed after --header-timeout while /health answers, past --max-connections new ones are
closed at once, and each is logged."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.e2e.servers import Server, get_json

pytestmark = pytest.mark.slow
# no end
HALF = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


async def half_sent(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HALF)
        conns.append((reader, writer))
    # past the cap: reset
    await asyncio.gather(*(w.drain() for _, w in conns), return_exceptions=True)
    return conns


async def all_closed(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
                     timeout: float) -> int:
    """How many the server closed (EOF or reset) within timeout."""
    async def closed(reader: asyncio.StreamReader) -> bool:
        try:
            return await asyncio.wait_for(reader.read(), timeout) == b""
        except (ConnectionError, OSError):
            return True
        except TimeoutError:
            return False

    results = await asyncio.gather(*(closed(r) for r, _ in conns))
    for _, w in conns:
        w.close()
    return sum(results)


def test_half_sent_headers_are_closed_while_health_answers(tiny_chat_model: Path,
                                                           tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    argv = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--kv-cache-memory",
            "32MiB", "--header-timeout", "3", "--max-connections", "1100"]
    with Server(argv, log_path=log) as server:
        async def main() -> None:
            conns = await half_sent(server.port, 1000)
            status, body = await asyncio.to_thread(get_json, server.url + "/health")
            assert status == 200, body
            assert await all_closed(conns, 60) == 1000
            status, _ = await asyncio.to_thread(get_json, server.url + "/health")
            assert status == 200
            conns = await half_sent(server.port, 1200)  # 100 past the cap
            assert await all_closed(conns, 60) == 1200

        asyncio.run(asyncio.wait_for(main(), 240))
        deadline = time.monotonic() + 30
        while "past the cap" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        text = log.read_text()
        assert "did not send a request's headers within 3s" in text, text[-3000:]
        assert "came past the cap of 1100 open connections" in text, text[-3000:]
