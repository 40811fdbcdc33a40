"""A real `conveyor serve` whose engine is SIGKILLed under load: the supervisor restarts it, /ready
goes 503 and back to 200, and every open stream (SSE and WebSocket, greedy and seeded) carries on to
exactly the text and usage of an uninterrupted run. Requests that cannot be resumed end with an
error event, and an engine that cannot start again makes the gateway give up and exit non-zero."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from shared.wire import ZMTP_TIMEOUT_MS
from tests.e2e.servers import Server, children, cmdline

pytestmark = pytest.mark.slow
# a step takes milliseconds: enough that every stream is mid-decode when the engine dies
MAX_TOKENS = 400
# (door, chat?, body): greedy and seeded, both doors
BODIES: list[tuple[str, bool, dict[str, Any]]] = [
    ("sse", False, {"prompt": "The quick brown fox", "temperature": 0}),
    ("sse", True, {"messages": [{"role": "user", "content": "Tell me a story"}], "temperature": 0}),
    ("sse", False, {"prompt": "Once upon a time", "temperature": 0.9, "seed": 11, "top_p": 0.95}),
    ("sse", True, {"messages": [{"role": "user", "content": "Hi!"}], "temperature": 1.0, "seed": 5,
                   "repetition_penalty": 1.2, "min_tokens": 20}),
    ("ws", False, {"prompt": "In the beginning", "temperature": 0, "logprobs": 2}),
    ("ws", True, {"messages": [{"role": "user", "content": "What is 2+2?"}], "temperature": 0}),
    ("ws", False, {"prompt": "Numbers: 1, 2, 3,", "temperature": 0.7, "seed": 3, "top_k": 40}),
    ("ws", True, {"messages": [{"role": "user", "content": "Write a poem"}], "temperature": 1.2,
                  "seed": 99}),
]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("restart") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", "--log-level", "warning"], log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module", params=["--deterministic", "default", "w4a8"])
def quantized_server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory,
                     request: pytest.FixtureRequest):
    """bfloat16 activations and int4 weights, the default model's configuration on CPUs with
    native bfloat16, with --deterministic and without, and float32 with w4a8 weights, its
    configuration on AVX2 CPUs, without the flag: the resubmitted prompt + delivered tokens are one
    prompt chunk, computed at another row count than the decode steps that produced them, so they
    continue exactly only where every row's arithmetic is its own (docs/determinism.md): under the
    flag on every CPU, and by default on AMX CPUs and under w4a8."""
    from engine.load import amx, int4_avx2

    if request.param == "default" and not amx.usable():
        pytest.skip("the bfloat16 int4 default is invariant on AMX CPUs only (docs/determinism.md)")
    if request.param == "w4a8" and not int4_avx2.usable():
        pytest.skip("w4a8 runs on CPUs with AVX2, FMA and F16C")
    bf16_int4 = ["--dtype", "bfloat16", "--quantization", "int4"]
    flags = {"--deterministic": ["--deterministic", *bf16_int4], "default": bf16_int4,
             "w4a8": ["--dtype", "float32", "--quantization", "w4a8"]}[request.param]
    log = tmp_path_factory.mktemp("restart-int4") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", *flags, "--log-level", "warning"],
                log_path=log) as srv:
        yield srv


def run(coro: Any, timeout: float = 240) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def engine_pid(server: Server) -> int:
    pids = [p for p in children(server.pid) if cmdline(p)[1:3] == ["-m", "engine"]]
    assert len(pids) == 1, pids
    return pids[0]


class Stream:
    """One request's chunks as they arrive: its text and token logprobs so far, its usage, whether
    it ended well."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.done = False

    def chunk(self, obj: dict[str, Any]) -> None:
        if "error" in obj:
            self.error = obj["error"]
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        for c in obj["choices"]:
            self.text.append(c["delta"].get("content") or "" if "delta" in c else c["text"])
            if c.get("logprobs"):  # a completion's (only that body asks for them)
                self.logprobs.extend(c["logprobs"]["token_logprobs"])
            self.finish_reason = c.get("finish_reason") or self.finish_reason


async def sse(session: aiohttp.ClientSession, url: str, chat: bool, body: dict[str, Any],
              out: Stream) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                out.done = True
            elif line.startswith(b"data: "):
                out.chunk(orjson.loads(line[6:]))


async def ws(session: aiohttp.ClientSession, url: str, chat: bool, body: dict[str, Any],
             out: Stream) -> None:
    async with session.ws_connect(url + "/v1/ws") as sock:
        await sock.send_str(orjson.dumps({"op": "chat.completions" if chat else "completions",
                                          "id": "x", "body": body}).decode())
        async for msg in sock:
            frame = orjson.loads(msg.data)
            if frame["event"] == "chunk":
                out.chunk(frame["data"])
            elif frame["event"] == "error":
                out.error = frame["error"]
                return
            else:
                out.done = frame["event"] == "done"
                return


async def run_all(url: str, bodies: list[tuple[str, bool, dict[str, Any]]], kill: int | None,
                  freeze: float = 0.0) -> list[Stream]:
    """Every body at once; with kill set, SIGKILL that pid once every stream is mid-decode (with
    freeze, SIGSTOP it instead and SIGCONT it that many seconds later)."""
    streams = [Stream() for _ in bodies]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=200)) as session:
        extra = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}
        tasks = [asyncio.create_task((sse if door == "sse" else ws)(session, url, chat,
                                                                    {**body, **extra}, s))
                 for (door, chat, body), s in zip(bodies, streams)]
        if kill is not None:
            while not all(len(s.text) >= 5 for s in streams):
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.005)
            assert not any(s.finish_reason for s in streams)  # all mid-decode
            if freeze:
                os.kill(kill, signal.SIGSTOP)
                # the fault itself lasts this long: not a wait for a condition
                await asyncio.sleep(freeze)
                os.kill(kill, signal.SIGCONT)
            else:
                os.kill(kill, signal.SIGKILL)
        await asyncio.gather(*tasks)
    return streams


async def poll_ready(url: str, seen: list[int], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                async with session.get(url + "/ready",
                                       timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if not seen or seen[-1] != resp.status:
                        seen.append(resp.status)
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.02)


def test_streams_survive_an_engine_sigkill(server: Server) -> None:
    check_streams_survive_a_sigkill(server)


def test_int4_streams_resume_exactly(quantized_server: Server) -> None:
    """The same text, and each token's logprob with the same bits, as each request run alone: every
    row's arithmetic is its own, so neither the other streams nor the resubmission change it (the
    tiny model's text alone would survive a last-bit change)."""
    check_streams_survive_a_sigkill(quantized_server, same_bits=True)


def check_streams_survive_a_sigkill(server: Server, same_bits: bool = False) -> None:
    """same_bits: the reference runs each request alone (one-row steps, where a switching default
    takes other kernels than for the eight at once), and the logprobs must have the same bits."""
    if same_bits:
        reference = [run(run_all(server.url, [body], kill=None))[0] for body in BODIES]
    else:
        reference = run(run_all(server.url, BODIES, kill=None))
    for s in reference:
        assert s.done and s.error is None and s.usage and s.usage["completion_tokens"] == MAX_TOKENS
    old = engine_pid(server)

    async def main() -> tuple[list[Stream], list[int]]:
        seen: list[int] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_ready(server.url, seen, stop))
        streams = await run_all(server.url, BODIES, kill=old)
        deadline = time.monotonic() + 120
        # generous: the new engine may still load
        while seen[-1:] != [200] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await poller
        return streams, seen

    streams, seen = run(main())
    for (door, _, body), got, want in zip(BODIES, streams, reference):
        assert got.error is None and got.done, (door, body, got.error)
        assert "".join(got.text) == "".join(want.text), (door, body)
        if same_bits:
            assert got.logprobs == want.logprobs, (door, body)  # floats compared exactly
        assert got.usage is not None and want.usage is not None
        assert (got.usage["prompt_tokens"], got.usage["completion_tokens"]) == \
            (want.usage["prompt_tokens"], MAX_TOKENS), (door, body)
        assert got.usage["total_tokens"] == got.usage["prompt_tokens"] + MAX_TOKENS
    assert seen[0] == 200 and 503 in seen and seen[-1] == 200, seen  # ready, not ready, ready again
    assert engine_pid(server) != old
    assert server.log_path is not None
    log = server.log_path.read_text()
    assert "engine_restart exit=signal=SIGKILL" in log, log[-3000:]
    assert "resuming 8 request(s)" in log, log[-3000:]


def test_streams_survive_an_engine_frozen_past_the_zeromq_heartbeat(server: Server) -> None:
    """SIGSTOP for twice ZeroMQ's heartbeat timeout: the gateway's connection is dropped and
    reconnects under the same routing identity while the frozen engine still holds the dead one
    (the engine's ROUTER hands the identity over; the client greets again until it hears READY).
    Every greedy stream ends as an uninterrupted run does, and /ready is 200 again within seconds
    of the SIGCONT."""
    greedy = [b for b in BODIES if b[2]["temperature"] == 0][:4]
    reference = run(run_all(server.url, greedy, kill=None))
    pid = engine_pid(server)

    async def main() -> tuple[list[Stream], list[int], float]:
        seen: list[int] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_ready(server.url, seen, stop))
        streams = await run_all(server.url, greedy, kill=pid, freeze=2 * ZMTP_TIMEOUT_MS / 1000)
        woke = time.monotonic()
        while seen[-1:] != [200] and time.monotonic() - woke < 30:
            await asyncio.sleep(0.05)
        stop.set()
        await poller
        return streams, seen, time.monotonic() - woke

    streams, seen, _ = run(main())
    for (door, _, body), got, want in zip(greedy, streams, reference):
        assert got.error is None and got.done, (door, body, got.error)
        assert "".join(got.text) == "".join(want.text), (door, body)
        assert got.usage is not None and want.usage is not None
        assert (got.usage["prompt_tokens"], got.usage["completion_tokens"]) == \
            (want.usage["prompt_tokens"], MAX_TOKENS), (door, body)
    assert 503 in seen and seen[-1] == 200, seen  # noticed while frozen, ready again after
    assert engine_pid(server) == pid  # the same engine: nothing restarted it
    assert server.log_path is not None and "resuming 4 request(s)" in server.log_path.read_text()


def test_a_request_that_cannot_resume_gets_an_error_event(server: Server) -> None:
    body = {"prompt": "Two at once", "n": 2, "temperature": 0.8, "seed": 1}
    streams = run(run_all(server.url, [("sse", False, body), ("ws", False, body)],
                          kill=engine_pid(server)))
    for s in streams:
        assert s.error is not None and "cannot be resumed" in s.error["message"], s.error
        assert s.finish_reason is None


def test_an_engine_that_cannot_start_again_makes_the_gateway_give_up(tiny_chat_model: Path,
                                                                     tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    log = tmp_path / "server.log"
    srv = Server(["serve", "--model", str(model), "--num-threads", "1", "--kv-cache-memory",
                  "16MiB", "--max-engine-restarts", "2"], log_path=log)
    with srv:
        # every later engine fails to load
        (model / "config.json").rename(model / "config.json.gone")
        os.kill(engine_pid(srv), signal.SIGKILL)
        deadline = time.monotonic() + 180
        assert srv.proc is not None
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.proc.poll() == 1, srv.log()
    text = log.read_text()
    assert text.count("engine_restart exit=") == 2 and "engine_crash_loop" in text, text[-3000:]


def test_health_tells_the_truth_about_a_frozen_idle_engine(server: Server) -> None:
    """Nothing in flight, the engine frozen: /health stays 200 (liveness) but says engine_connected
    false once ZeroMQ's heartbeat drops the connection (no round trip per probe), /ready is 503;
    after SIGCONT both say so again within seconds."""
    from tests.e2e.servers import get_json

    def wait_for(connected: bool, ready: int) -> None:
        deadline = time.monotonic() + 3 * ZMTP_TIMEOUT_MS / 1000
        while time.monotonic() < deadline:
            status, body = get_json(server.url + "/health", timeout=5)
            assert status == 200, body
            if body["engine_connected"] is connected and (
                    get_json(server.url + "/ready", timeout=5)[0] == ready):
                return
            time.sleep(0.1)
        raise AssertionError(
            f"/health engine_connected did not become {connected} (/ready {ready})")

    pid = engine_pid(server)
    wait_for(True, 200)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(False, 503)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(True, 200)
