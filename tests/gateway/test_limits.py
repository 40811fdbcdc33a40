"""The front door's limits against a fake engine: 401, 413, 429 (+ Retry-After) for each cap, 503
for an engine that is gone and recovery when it is back, /health vs /ready, and env
configuration."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.admission import Admission, Limits
from gateway.auth import Auth
from shared.errors import Overloaded
from tests.fakes import FakeEngine
from tests.gateway.test_routes import gateway, run

LONG_STREAM = {"prompt": "hi", "max_tokens": 500, "stream": True}


def slow_engine(**kw: Any) -> FakeEngine:
    return FakeEngine(tokens=list(range(300, 1300)), step_interval=0.01, max_model_len=4096, **kw)


def test_api_key_guards_everything_but_probes() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng, auth=Auth(("sk-test",))) as http:
                for method, path in [("post", "/v1/completions"), ("get", "/v1/models"),
                                     ("post", "/tokenize")]:
                    resp = await getattr(http, method)(path, json={"prompt": "hi"})
                    assert resp.status == 401, path
                    err = (await resp.json())["error"]
                    assert err["type"] == "authentication_error" and "API key" in err["message"]
                    assert resp.headers["WWW-Authenticate"] == "Bearer"
                wrong = await http.post("/v1/completions", json={"prompt": "hi"},
                                        headers={"Authorization": "Bearer no"})
                assert wrong.status == 401
                ok = await http.post("/v1/completions", json={"prompt": "hi"},
                                     headers={"Authorization": "Bearer sk-test"})
                assert ok.status == 200
                for path in ("/health", "/ready", "/metrics"):
                    assert (await http.get(path)).status == 200, path
    run(main())


def test_body_too_large_is_413() -> None:
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng, max_body_size=1000) as http:
                resp = await http.post("/v1/completions", json={"prompt": "x" * 2000})
                assert resp.status == 413
                err = (await resp.json())["error"]
                assert "larger than this server's limit of 1000 bytes" in err["message"]
                assert (await http.post("/v1/completions", json={"prompt": "x"})).status == 200
    run(main())


@pytest.mark.parametrize("limits, second, reason", [
    (Limits(max_concurrent_requests=1), {"prompt": "hi"}, "--max-concurrent-requests"),
    (Limits(max_waiting_requests=1), {"prompt": "hi"}, "--max-waiting-requests"),
    (Limits(max_queued_prompt_tokens=10), {"prompt": "hi " * 20}, "--max-queued-prompt-tokens"),
], ids=["concurrent", "waiting", "prompt-tokens"])
def test_caps_answer_429_with_retry_after_before_queueing(limits: Limits, second: dict[str, Any],
                                                          reason: str) -> None:
    async def main() -> None:
        # The first request holds its place: for the waiting caps the fake engine never starts it.
        waiting_cap = limits.max_concurrent_requests > 1
        with slow_engine() as eng:
            if waiting_cap:
                eng._step = lambda: None  # type: ignore[method-assign]  # a queue that never moves: requests stay waiting
            async with gateway(eng, limits=limits) as http:
                first = asyncio.ensure_future(http.post("/v1/completions",
                                                        json={**LONG_STREAM, "prompt": "hi hi"}))
                assert await asyncio.to_thread(eng.wait_for, lambda: len(eng.adds()) == 1)
                resp = await http.post("/v1/completions", json=second)
                assert resp.status == 429
                assert int(resp.headers["Retry-After"]) >= 1
                err = (await resp.json())["error"]
                assert err["type"] == "rate_limit_error" and reason in err["message"]
                assert len(eng.adds()) == 1  # refused before anything was queued
                metrics = await (await http.get("/metrics")).text()
                assert "conveyor_requests_rejected_total{reason=" in metrics
                first.cancel()
    run(main())


def test_refusal_carries_its_cap_and_wait_as_fields() -> None:
    """Overloaded names the cap that refused (the metrics label) and the seconds for Retry-After;
    nothing of a refused request is counted in."""
    adm = Admission(Limits(max_concurrent_requests=2, max_queued_prompt_tokens=10))
    adm.admit("a", 5)
    with pytest.raises(Overloaded) as e:
        adm.admit("b", 6)
    assert (e.value.reason, e.value.retry_after, e.value.status) == ("prompt_tokens", 1, 429)
    assert adm.in_flight == {"a"} and adm.queued_tokens == 5
    adm.admit("c", 5)
    with pytest.raises(Overloaded) as e:
        adm.admit("d", 1)
    assert e.value.reason == "concurrent"


def test_engine_gone_is_503_then_gateway_reconnects() -> None:
    async def main() -> None:
        eng = FakeEngine(tokens=[7, 8]).__enter__()
        address = eng.address
        async with gateway(eng, health_timeout=0.5) as http:
            assert (await http.get("/ready")).status == 200
            eng.stop()
            for _ in range(100):  # the socket monitor notices the loss
                if (await http.get("/ready")).status == 503:
                    break
                await asyncio.sleep(0.05)
            resp = await http.post("/v1/completions", json={"prompt": "hi"})
            assert resp.status == 503 and "Retry-After" in resp.headers
            err = (await resp.json())["error"]
            assert err["type"] == "service_unavailable" and "not connected" in err["message"]
            health = await http.get("/health")  # alive all along: the gateway itself is fine
            assert health.status == 200 and (await health.json())["engine_connected"] is False
            with FakeEngine(tokens=[7, 8], address=address):  # the engine is back on its address
                for _ in range(200):
                    if (await http.get("/ready")).status == 200:
                        break
                    await asyncio.sleep(0.05)
                resp = await http.post("/v1/completions", json={"prompt": "hi"})
                assert resp.status == 200, await resp.text()
    run(main())


def test_open_stream_ends_with_error_event_when_engine_dies() -> None:
    """...and does not come back within resume_timeout (a restarted engine resumes it:
    test_resume.py)."""
    async def main() -> None:
        eng = slow_engine().__enter__()
        async with gateway(eng, resume_timeout=0.5) as http:
            resp = await http.post("/v1/completions", json=LONG_STREAM)
            await resp.content.readline()
            eng.stop()
            body = await resp.read()
            assert b"service_unavailable" in body and body.endswith(b"data: [DONE]\n\n")
    run(main())


def test_flags_come_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli import build_parser, gateway_config

    monkeypatch.setenv("CONVEYOR_API_KEY", "from-env")
    monkeypatch.setenv("CONVEYOR_MAX_WAITING_REQUESTS", "7")
    monkeypatch.setenv("CONVEYOR_ENGINE_ADDRESS", "tcp://engine:5555")
    args = build_parser().parse_args(["gateway", "--max-body-size", "1MiB"])
    config = gateway_config(args)
    assert args.engine_address == "tcp://engine:5555" and config.auth.keys == ("from-env",)
    assert config.limits.max_waiting_requests == 7 and config.max_body_size == 2**20
    args = build_parser().parse_args(["gateway", "--max-waiting-requests", "9"])  # the flag wins
    assert args.max_waiting_requests == 9


def test_a_body_cut_short_by_the_client_is_no_server_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """A client that sends half its body and hangs up (the disconnect storm's race) leaves no ERROR
    or traceback in the log, and the server goes on answering."""
    async def main() -> None:
        with FakeEngine() as eng:
            async with gateway(eng) as http:
                host, port = http.server.host, http.server.port
                for _ in range(5):
                    reader, writer = await asyncio.open_connection(host, port)
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                 b"application/json\r\n" b"Content-Length: "
                                                         b"1000\r\n\r\n{\"prompt\": \"hi")
                    await writer.drain()
                    writer.close()
                    await writer.wait_closed()
                deadline = asyncio.get_running_loop().time() + 30
                while "the client went away" not in caplog.text:  # the gateway saw the cut bodies
                    assert asyncio.get_running_loop().time() < deadline, caplog.text
                    await asyncio.sleep(0.05)
                assert (await http.post("/v1/completions", json={"prompt": "hi"})).status == 200
    with caplog.at_level("INFO", logger="gateway.app"):
        run(main())
    bad = [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
