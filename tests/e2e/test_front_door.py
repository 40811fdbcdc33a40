"""A real `conveyor serve` on a tiny random chat model: /metrics as Prometheus sees it, and the
WebSocket endpoint (interleaved requests, cancel, malformed messages), checked against the
engine's own STATS."""
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
    log = tmp_path_factory.mktemp("front") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", "--log-level", "info"], log_path=log) as srv:
        yield srv


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        return parse(await resp.text())


def test_metrics_parse_and_move(server: Server) -> None:
    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            before = await scrape(session, server.url)
            body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            for _ in range(2):
                async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
            long = {**body, "max_tokens": 500, "stream": True}
            async with session.post(f"{server.url}/v1/completions", json=long) as resp:
                await resp.content.readline()
                mid = await scrape(session, server.url)  # while one request runs
            for _ in range(100):
                after = await scrape(session, server.url)
                if after.get("conveyor_requests_total{finish_reason=abort}", 0) > before.get(
                        "conveyor_requests_total{finish_reason=abort}", 0):
                    break
                await asyncio.sleep(0.05)
            return before, mid, after

    before, mid, after = run(main())

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("conveyor_requests_total{finish_reason=length}") == 2
    assert moved("conveyor_requests_total{finish_reason=abort}") == 1
    assert moved("conveyor_generation_tokens_total") >= 12
    assert moved("conveyor_prompt_tokens_total") >= 3 * 2
    assert moved("conveyor_time_to_first_token_seconds_count") == 3
    assert moved("conveyor_inter_token_latency_seconds_count") >= 10
    assert moved("conveyor_e2e_request_latency_seconds_count") == 3
    assert moved("conveyor_prefix_cache_queries_total") == moved("conveyor_prompt_tokens_total")
    assert mid["conveyor_num_requests_running"] + mid["conveyor_num_requests_waiting"] == 1
    assert mid["conveyor_kv_cache_usage_ratio"] > 0 and mid["conveyor_requests_in_flight"] == 1
    # the finished requests' latencies: engine timestamps
    assert mid["conveyor_latency_source_engine"] == 1
    for name in ("conveyor_num_requests_swapped", "conveyor_num_preemptions_total",
                 "conveyor_prefix_cache_hit_rate", "conveyor_request_queue_time_seconds_count",
                 "conveyor_engine_up"):
        assert name in after, name
    assert after["conveyor_engine_up"] == 1 and after["conveyor_requests_in_flight"] == 0


# -- WebSocket -------------------------------------------------------------------------------------


async def http_text(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        return (await resp.json())["choices"][0]["text"]


def test_websocket_interleaves_cancels_and_survives_bad_messages(server: Server,
                                                                 engine_address: str) -> None:
    bodies = {"a": {"prompt": "First story", "max_tokens": 24},
              "b": {"prompt": "Second story, a long one", "max_tokens": 600},
              "c": {"prompt": "Third story", "max_tokens": 16}}
    bodies = {k: {**v, "temperature": 0, "ignore_eos": True} for k, v in bodies.items()}

    async def main() -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]], dict[str, str],
                              dict[str, float]]:
        frames: dict[str, list[dict[str, Any]]] = {k: [] for k in bodies}
        errors: list[dict[str, Any]] = []
        async with aiohttp.ClientSession() as session:
            expected = {k: await http_text(session, server.url, v) for k, v in bodies.items()
                        if k != "b"}
            async with session.ws_connect(f"{server.url}/v1/ws") as ws:
                await ws.send_json({"op": "completions", "id": "b", "body": bodies["b"]})
                await ws.send_json({"op": "completions", "id": "a", "body": bodies["a"]})
                await ws.send_str("{not json")  # malformed messages between live requests
                await ws.send_json({"op": "completions", "id": "c", "body": bodies["c"]})
                await ws.send_json([1, 2])
                await ws.send_json({"op": "explode", "id": "x"})
                # b is streaming already
                await ws.send_json({"op": "completions", "id": "b", "body": bodies["b"]})
                await ws.send_json({"op": "completions", "id": "d",
                                    "body": {"prompt": "hi", "max_tokens": -1}})
                await ws.send_json({"op": "completions", "body": {"prompt": "hi"}})  # no id
                await ws.send_bytes(b"\x00binary")
                finished: set[str] = set()
                cancel_sent = False
                while finished != {"a", "b", "c"}:
                    msg = await ws.receive_json()
                    if msg["event"] == "error":
                        errors.append(msg)
                        continue
                    frames[msg["id"]].append(msg)
                    if msg["event"] in ("done", "cancelled"):
                        finished.add(msg["id"])
                    if msg["id"] == "b" and len(frames["b"]) == 3 and not cancel_sent:
                        await ws.send_json({"op": "cancel", "id": "b"})
                        cancel_sent = True
                await ws.send_json({"op": "cancel", "id": "b"})  # idempotent: no answer, no error
                # ids are reusable
                await ws.send_json({"op": "completions", "id": "a", "body": bodies["a"]})
                again = [await ws.receive_json() for _ in range(2)]
                while again[-1]["event"] != "done":
                    again.append(await ws.receive_json())
        stats = await wait_engine_idle(engine_address, timeout=10)
        frames["a2"] = again
        return frames, errors, expected, stats

    frames, errors, expected, stats = run(main())
    for k in ("a", "c"):
        assert frames[k][-1] == {"id": k, "event": "done"}
        chunks = [f["data"] for f in frames[k][:-1]]
        assert all(f["event"] == "chunk" and f["data"]["object"] == "text_completion"
                   for f in frames[k][:-1])
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected[k]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert frames["b"][-1] == {"id": "b", "event": "cancelled"} and len(frames["b"]) < 100
    assert "".join(f["data"]["choices"][0]["text"] for f in frames["a2"][:-1]) == expected["a"]
    # the cancelled request is gone from the engine and its blocks are free
    assert is_idle(stats), stats
    by_id = sorted((str(e["id"]), e["status"]) for e in errors)
    assert by_id == [("None", 400)] * 4 + [("b", 400), ("d", 400), ("x", 400)], errors
    messages = " | ".join(e["error"]["message"] for e in errors)
    for needle in ("not valid JSON", "JSON object", "'op' must be", "already streaming",
                   "max_tokens", "'id' must", "binary frames"):
        assert needle in messages, needle


def test_examples_and_load_generator_run(server: Server, engine_address: str,
                                         tiny_chat_model: Path) -> None:
    """The documented examples and bench/serving.py's load mode, as a user runs them."""
    import subprocess
    import sys

    from tests.e2e.servers import ROOT

    def run_script(*argv: str) -> str:
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    out = run_script("examples/sdk_client.py", "--engine-address", engine_address, "--model",
                     str(tiny_chat_model))
    for needle in ("connected: tiny-chat", "finished=True reason=length", "aborted after",
                   "refused (400)", "sync:", "choice 1:", "no engine there (503)"):
        assert needle in out, out
    out = run_script("examples/websocket_client.py", "--url",
                     server.url.replace("http", "ws") + "/v1/ws")
    assert "[b] cancelled" in out and "[a] done" in out and "[c] done" in out, out
    out = run_script("bench/serving.py", "load", "--url", server.url, "--concurrency", "4",
                     "--rates", "20", "--num-requests", "8", "--output-len", "4,8", "--prompt-len",
                     "8,16")
    assert out.count("    8 ok   0 failed") == 2 and "TTFT p50" in out, out
    stats = run(wait_engine_idle(engine_address))
    assert is_idle(stats), stats
