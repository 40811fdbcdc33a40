"""Grammar compiles against a real `conveyor serve`: a compile cannot hold the compiler from other
clients. Four clients each send a distinct JSON schema nested 900 deep (minutes of compiling each)
and leave: their compiles are killed with their requests, and another client's json_object request
is answered within the compile budget. A bomb whose client stays gets a 400 naming the budget."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.servers import Server

pytestmark = pytest.mark.slow
BUDGET = 10.0  # --grammar-compile-timeout for this server


def bomb(tag: str, depth: int = 900) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "description": tag}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}


def body(response_format: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 8,
            "temperature": 0, "response_format": response_format}


async def post(session: aiohttp.ClientSession, url: str,
               payload: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url + "/v1/chat/completions", json=payload) as resp:
        return resp.status, await resp.json()


async def waiting_grammars(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("conveyor_engine_num_waiting_grammar "):
                return float(line.split()[-1])
    return -1.0


def test_abandoned_grammar_bombs_do_not_hold_the_compiler(tiny_chat_model: Path,
                                                          tmp_path: Path) -> None:
    argv = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--kv-cache-memory",
            "32MiB", "--grammar-compile-timeout", str(BUDGET)]
    with Server(argv, log_path=tmp_path / "server.log") as server:
        async def main() -> None:
            url = server.url
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
                status, _ = await post(session, url, body({"type": "json_object"}))  # compilers up
                assert status == 200
                bombs = [asyncio.create_task(post(session, url, body(bomb(f"bomb {i}"))))
                         for i in range(4)]
                deadline = time.monotonic() + 60
                while await waiting_grammars(session, url) < 4 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                for task in bombs:  # the clients leave: the gateway aborts their requests
                    task.cancel()
                await asyncio.gather(*bombs, return_exceptions=True)
                start = time.monotonic()
                status, answer = await post(session, url, body({"type": "json_object"}))
                waited = time.monotonic() - start
                assert status == 200, answer
                assert waited < BUDGET, (
                    f"a json_object request waited {waited:.1f}s behind abandoned compiles")
                # A bomb whose client stays: refused when the budget runs out, naming it.
                start = time.monotonic()
                status, answer = await post(session, url, body(bomb("stays")))
                assert status == 400 and f"{BUDGET:g}s budget" in answer["error"]["message"], answer
                assert time.monotonic() - start < 3 * BUDGET
                status, _ = await post(session, url, body({"type": "json_object"}))
                assert status == 200

        asyncio.run(asyncio.wait_for(main(), 400))
