"""/v1/ws against a fake engine: auth, limits and lifecycle (the interleaving and cancel tests with
a real engine are in tests/e2e/test_front_door.py)."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gateway.admission import Limits
from gateway.auth import Auth
from tests.fakes import FakeEngine
from tests.gateway.test_routes import gateway, run


def slow_engine() -> FakeEngine:
    return FakeEngine(tokens=list(range(300, 1300)), step_interval=0.01, max_model_len=4096)


async def frames_until(ws: Any, pred: Any) -> list[dict[str, Any]]:
    out = []
    while True:
        out.append(await asyncio.wait_for(ws.receive_json(), 10))
        if pred(out[-1]):
            return out


def test_api_key_on_upgrade_header_or_query() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng, auth=Auth(("sk-ws",))) as http:
                with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                    await http.ws_connect("/v1/ws")
                assert info.value.status == 401
                ways: list[dict[str, Any]] = [{"headers": {"Authorization": "Bearer sk-ws"}},
                                              {"params": {"api_key": "sk-ws"}}]
                for kw in ways:
                    ws = await http.ws_connect("/v1/ws", **kw)
                    await ws.send_json({"op": "completions", "id": "a",
                                        "body": {"prompt": "hi", "max_tokens": 2}})
                    frames = await frames_until(ws, lambda f: f["event"] == "done")
                    assert frames[0]["event"] == "chunk"
                    await ws.close()
    run(main())


def test_oversized_message_gets_413_frame_and_socket_lives() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng, max_body_size=2000) as http:
                ws = await http.ws_connect("/v1/ws")
                await ws.send_json({"op": "completions", "id": "big",
                                    "body": {"prompt": "x" * 3000}})
                err = await ws.receive_json()
                assert err["event"] == "error" and err["status"] == 413
                assert "limit of 2000 bytes" in err["error"]["message"]
                await ws.send_json({"op": "completions", "id": "ok",
                                    "body": {"prompt": "hi", "max_tokens": 2}})
                assert (await frames_until(ws, lambda f: f["event"] == "done"))[-1]["id"] == "ok"
                await ws.close()
    run(main())


def test_admission_429_is_an_error_frame_with_retry_after() -> None:
    async def main() -> None:
        with slow_engine() as eng:
            async with gateway(eng, limits=Limits(max_concurrent_requests=1)) as http:
                ws = await http.ws_connect("/v1/ws")
                await ws.send_json({"op": "completions", "id": "a",
                                    "body": {"prompt": "hi", "max_tokens": 500}})
                await frames_until(ws, lambda f: f["event"] == "chunk")
                await ws.send_json({"op": "completions", "id": "b", "body": {"prompt": "hi"}})
                frames = await frames_until(ws, lambda f: f["id"] == "b")
                assert frames[-1]["status"] == 429 and frames[-1]["retry_after"] >= 1
                assert frames[-1]["error"]["type"] == "rate_limit_error"
                await ws.close()
    run(main())


def test_closing_the_socket_aborts_its_requests() -> None:
    async def main() -> None:
        with slow_engine() as eng:
            async with gateway(eng) as http:
                ws = await http.ws_connect("/v1/ws")
                for cid in ("a", "b", "c"):
                    await ws.send_json({"op": "completions", "id": cid,
                                        "body": {"prompt": "hi", "max_tokens": 500}})
                await frames_until(ws, lambda f: f["event"] == "chunk")
                assert await asyncio.to_thread(eng.wait_for, lambda: len(eng.adds()) == 3)
                await ws.close()
                assert await asyncio.to_thread(eng.wait_for, lambda: len(eng.aborted) == 3)
                assert sorted(eng.aborted) == sorted(a.request_id for a in eng.adds())
                metrics = await (await http.get("/metrics")).text()
                assert 'conveyor_requests_total{finish_reason="abort"} 3.0' in metrics
    run(main())


def test_responses_websocket_mode_answers_oversized_and_binary_messages_and_lives() -> None:
    """GET /v1/responses upgraded (OpenAI's WebSocket mode) shares /v1/ws's message loop
    (gateway/socket_messages.py): a message over the body limit is a 413 error event, a binary one
    a 400, and the socket then still serves a response.create."""
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng, max_body_size=2000) as http:
                ws = await http.ws_connect("/v1/responses")
                await ws.send_json({"type": "response.create", "input": "x" * 3000})
                err = await ws.receive_json()
                assert err["type"] == "error" and err["status"] == 413
                assert "limit of 2000 bytes" in err["error"]["message"]
                await ws.send_bytes(b"\x00binary")
                err = await ws.receive_json()
                assert err["type"] == "error" and err["status"] == 400
                assert "binary frames" in err["error"]["message"]
                await ws.send_json({"type": "response.create", "input": "hi",
                                    "max_output_tokens": 2})
                events: list[dict[str, Any]] = []
                while not events or events[-1]["type"] not in ("response.completed",
                                                               "response.incomplete"):
                    events.append(await asyncio.wait_for(ws.receive_json(), 10))
                assert events[0]["type"] == "response.created"
                await ws.close()
    run(main())
