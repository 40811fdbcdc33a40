"""`conveyor serve --gateway-workers 2`: two gateway processes on one port and one engine; streams equal
the offline API's output, connections land on both, both enforce the API key, /metrics sums both, and
SIGTERM stops all three."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from gateway.metrics import parse
from tests.e2e.conftest import stream_completion
from tests.e2e.servers import Server, children, cmdline

pytestmark = pytest.mark.slow


def test_two_workers_share_port_engine_and_metrics(tiny_chat_model: Path, tmp_path: Path,
                                                    tiny_offline: Callable[[list[str], int], list[str]]) -> None:
    prompts = [f"Worker test {i}:" for i in range(12)]
    expected = tiny_offline(prompts, 12)
    log = tmp_path / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--gateway-workers", "2", "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", "--log-level", "info", "--api-key", "sk-workers"], log_path=log) as srv:
        kids = {pid: cmdline(pid) for pid in children(srv.pid)}
        engines = [p for p, argv in kids.items() if argv[1:3] == ["-m", "engine"]]
        workers = [p for p, argv in kids.items() if argv[1:4] == ["-m", "gateway", "gateway"]]
        assert len(engines) == 1 and len(workers) == 1, kids
        assert "--reuse-port" in kids[workers[0]] and srv.engine_address in kids[workers[0]]

        async def main() -> tuple[list[str], list[dict[str, float]]]:
            connector = aiohttp.TCPConnector(force_close=True)  # one connection per request: the kernel spreads them
            auth = {"Authorization": "Bearer sk-workers"}  # --api-key reaches the worker too (by environment)
            async with aiohttp.ClientSession(connector=connector, headers=auth) as session:
                # The workers serve first and the parent binds the port last: wait until both answered.
                for _ in range(200):
                    if len(set(re.findall(r"pid=(\d+) msg=.*GET /ready", log.read_text()))) == 2:
                        break
                    async with session.get(f"{srv.url}/ready"):
                        await asyncio.sleep(0.02)
                texts = await asyncio.gather(*[stream_completion(session, srv.url, p, 12) for p in prompts])
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as anon:
                    for _ in range(4):
                        async with anon.get(f"{srv.url}/v1/models") as resp:
                            assert resp.status == 401
                scrapes = []
                for _ in range(6):
                    async with session.get(f"{srv.url}/metrics") as resp:
                        scrapes.append(parse(await resp.text()))
            return texts, scrapes

        texts, scrapes = asyncio.run(asyncio.wait_for(main(), 120))
        assert texts == expected
        served_by = set(re.findall(r"pid=(\d+) msg=.*POST /v1/completions", log.read_text()))
        assert served_by == {str(srv.pid), str(workers[0])}, served_by
        for m in scrapes:  # whichever worker answers the scrape, it reports the sum over both
            assert m["conveyor_requests_total{finish_reason=length}"] == len(prompts)
            assert m["conveyor_generation_tokens_total"] == 12 * len(prompts)
            assert m["conveyor_time_to_first_token_seconds_count"] == len(prompts)
            assert m["conveyor_engine_up"] == 1
    assert srv.proc is not None and srv.proc.returncode == 0
