"""200 clients that go away at random moments under load: while queued, during a chunked prefill,
during decode, while preempted or swapped out by KV pressure, and so necessarily while the engine is
mid-step. Afterwards the engine holds no request and every block is free, nothing was logged as an
error, and a normal request still gets the offline API's exact text."""
from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from gateway.engine_metrics import num_preemptions
from tests.e2e.conftest import stream_completion
from tests.e2e.servers import Server, is_idle, wait_engine_idle

pytestmark = pytest.mark.slow
NUM_CLIENTS = 200
CONCURRENCY = 24


async def one_client(session: aiohttp.ClientSession, url: str, rng: random.Random,
                     outcome: Counter[str]) -> None:
    # a few prefill chunks of 64
    prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(60, 260))]
    body = {"prompt": prompt, "max_tokens": rng.randint(20, 300), "ignore_eos": True,
            "temperature": 0.8, "seed": rng.randrange(10**6), "stream": True}
    patience = rng.choice([0.0, 0.02, 0.1]) + rng.expovariate(1 / 0.4)  # then the client goes away
    kind = rng.choice(["sse", "sse", "ws-cancel", "ws-close"])
    if rng.random() < 0.1:
        patience = 1e9  # some run to the end
    try:
        if kind == "sse":
            await asyncio.wait_for(_sse(session, url, body, outcome), patience)
        else:
            await _ws(session, url, body, patience, kind == "ws-cancel", outcome)
    except TimeoutError:
        outcome[f"{kind}-gone"] += 1


async def _sse(session: aiohttp.ClientSession, url: str, body: dict, outcome: Counter[str]) -> None:
    # undone below once the headers (sent with the first token) arrive
    outcome["sse-before-first-token"] += 1
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        outcome["sse-before-first-token"] -= 1
        if resp.status == 429:
            outcome["429"] += 1
            return
        assert resp.status == 200, await resp.text()
        async for _ in resp.content:
            pass
    outcome["sse-complete"] += 1


async def _ws(session: aiohttp.ClientSession, url: str, body: dict, patience: float, cancel: bool,
              outcome: Counter[str]) -> None:
    async with session.ws_connect(f"{url}/v1/ws") as ws:
        await ws.send_json({"op": "completions", "id": "r", "body": body})
        deadline = asyncio.get_running_loop().time() + patience
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                msg = await asyncio.wait_for(ws.receive_json(), max(left, 0))
            except TimeoutError:
                if not cancel:
                    outcome["ws-close-gone"] += 1
                    return  # leaving the `async with` closes the socket with the request running
                await ws.send_json({"op": "cancel", "id": "r"})
                while (msg := await ws.receive_json())["event"] == "chunk":
                    pass
                assert msg["event"] in ("cancelled", "done"), msg
                outcome["ws-cancelled"] += 1
                return
            if msg["event"] in ("done", "error"):
                outcome["ws-" + msg["event"]] += 1
                return


def test_200_random_disconnects_leave_engine_clean(
        tiny_chat_model: Path, tmp_path: Path,
        tiny_offline: Callable[[list[str], int], list[str]]) -> None:
    expected = tiny_offline(["After the storm"], 24)[0]
    log = tmp_path / "server.log"
    # 48 blocks of 16 tokens for up to 16 sequences of up to ~560 tokens: preemption (swap or
    # recompute) is certain; a 64-token step budget cuts every prompt into several prefill chunks.
    args = ["serve", "--model", str(tiny_chat_model), "--num-threads", "1", "--num-kv-blocks", "48",
            "--block-size", "16", "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
            "--log-level", "info"]
    with Server(args, log_path=log) as srv:
        address = srv.engine_address

        async def main() -> tuple[Counter[str], dict[str, float], dict[str, float], str]:
            rng = random.Random(1234)
            outcome: Counter[str] = Counter()
            peak: dict[str, float] = {}
            sem = asyncio.Semaphore(CONCURRENCY)

            async def limited(session: aiohttp.ClientSession) -> None:
                async with sem:
                    await one_client(session, srv.url, rng, outcome)

            async def watch(stop: asyncio.Event) -> None:
                from shared.client import AsyncEngineClient

                async with AsyncEngineClient(address, name="storm-watch") as client:
                    while not stop.is_set():
                        stats = await client.get_stats()
                        stats["num_preemptions"] = num_preemptions(stats)
                        for key in ("num_running", "num_waiting", "num_swapped", "num_preemptions"):
                            peak[key] = max(peak.get(key, 0), stats.get(key, 0))
                        await asyncio.sleep(0.02)

            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                await asyncio.gather(*[limited(session) for _ in range(NUM_CLIENTS)])
                stop.set()
                await watcher
                stats = await wait_engine_idle(address, timeout=30)
                text = await stream_completion(session, srv.url, "After the storm", 24)
            return outcome, stats, dict(peak), text

        outcome, stats, peak, text = asyncio.run(asyncio.wait_for(main(), 240))
    print(f"outcomes: {dict(outcome)}; peaks: {peak}")
    assert is_idle(stats), stats
    assert stats["num_running"] == 0
    assert stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert text == expected  # blocks freed by 200 aborts are reused without a trace
    assert peak["num_preemptions"] > 0 and peak["num_waiting"] > 0, peak  # the moments did happen
    gone = sum(v for k, v in outcome.items() if k.endswith("gone") or k == "ws-cancelled")
    assert gone >= NUM_CLIENTS // 2 and outcome["sse-before-first-token"] > 0, outcome
    bad = [line for line in log.read_text().splitlines() if "level=ERROR" in line
           or "Traceback" in line or "unknown request" in line.lower()]
    assert not bad, "\n".join(bad[:20])
