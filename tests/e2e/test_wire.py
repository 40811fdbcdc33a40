"""The wire's limits against a real engine process over real sockets: CURVE keys, an oversized
message, a flood of messages, and the heartbeat that notices a frozen engine. Deadlines are
generous; nothing is timed."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine.loop import MAX_DRAIN_PER_STEP
from shared import protocol as P
from shared.client import AsyncEngineClient
from shared.errors import EngineDead, InvalidRequest
from shared.sampling import SamplingParams
from shared.stream import RequestStream
from shared.wire import generate_keys, load_keys
from tests.e2e.servers import Server, engine_stats, free_port, is_idle, wait_engine_idle

pytestmark = pytest.mark.slow
LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


@contextmanager
def engine(model: Path, address: str, log: Path, *extra: str,
           client_keys: Path | None = None) -> Iterator[Server]:
    """A bare engine process, yielded once it answers a client (it loads its model first: the tests'
    own clients then keep the SDK's default deadlines). client_keys: for an engine started with
    --curve-keys."""
    argv = [sys.executable, "-m", "engine", "--address", address, "--model", str(model),
            "--num-threads", "1", "--kv-cache-memory", "16MiB", *extra]
    with Server(argv, exact_argv=True, health_path=None, log_path=log) as server:
        run(engine_stats(address, client_keys))
        yield server


@pytest.fixture
def ipc_engine(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[Server, str]]:
    address = f"ipc://{tmp_path}/engine.sock"
    with engine(tiny_llama_dir, address, tmp_path / "engine.log") as server:
        yield server, address


async def collect(stream: RequestStream) -> list[P.RequestOutput]:
    return [o async for o in stream]


async def raw_dealer(ctx: zmq.asyncio.Context, address: str,
                     keys: Path | None = None) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        k = load_keys(keys, "client")
        sock.curve_secretkey, sock.curve_publickey = k.secret, k.public
        sock.curve_serverkey = k.engine_public
    return sock


async def next_event(monitor: zmq.asyncio.Socket, wanted: AbstractSet[int],
                     timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await monitor.poll(100):
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event in wanted:
                return event
    raise AssertionError(f"none of the socket events {wanted} within {timeout}s")


def test_curve_keys_admit_only_the_engines_clients(tiny_llama_dir: Path, tmp_path: Path) -> None:
    keys, other = generate_keys(tmp_path / "keys"), generate_keys(tmp_path / "other")
    address = f"tcp://127.0.0.1:{free_port()}"
    prompt = list(range(3, 40))  # two full blocks: a cached prefix that a reset would drop

    async def main() -> None:
        async with AsyncEngineClient(address, curve_keys=keys[1], ready_timeout=120) as good:
            outs = await collect(await good.add(prompt,
                                                SamplingParams(max_tokens=4, temperature=0.0)))
            assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 4
            before = await good.get_stats()
            assert before["num_cached_device_blocks"] >= 2

            # Raw sockets that ignore the handshake's failure: with no keys and with another
            # engine's keys.
            ctx = zmq.asyncio.Context()
            try:
                for bad_keys in (None, other[1]):
                    sock = await raw_dealer(ctx, address, bad_keys)
                    monitor = sock.get_monitor_socket()
                    sock.connect(address)
                    for msg in (P.Hello(), P.Add("intruder", prompt, LONG), P.ResetPrefixCache(),
                                P.GetStats()):
                        try:  # never blocks: once the handshake fails, the pipe is dropped and a
                            # blocking send would wait for a peer that never comes
                            await sock.send_multipart(P.encode(msg), flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break  # nothing more can go out, which is the point
                    failed = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                              zmq.EVENT_DISCONNECTED}
                    await next_event(monitor, failed)
                    assert not await sock.poll(0), "an unauthenticated client got an answer"
                    sock.disable_monitor()
                    sock.close()
            finally:
                ctx.destroy(linger=0)

            # The SDK without keys, or with the wrong ones: a clear error within its
            # deadline, nothing sent.
            for bad_keys in (None, other[1]):
                bad = AsyncEngineClient(address, curve_keys=bad_keys, ready_timeout=10)
                start = time.monotonic()
                with pytest.raises(EngineDead, match="refused this client|did not answer HELLO"):
                    await bad.start()
                assert time.monotonic() - start < 60  # its 10 s deadline, not a hang
                for call in (bad.add(prompt, LONG), bad.get_stats(), bad.reset_prefix_cache()):
                    with pytest.raises(EngineDead):
                        await call
                await bad.close()

            # nothing of theirs reached the engine: no request, no reset
            after = await good.get_stats()
            assert after["total_prefill_tokens"] == before["total_prefill_tokens"]
            assert after["num_cached_device_blocks"] == before["num_cached_device_blocks"]
            assert is_idle(after)
            await good.reset_prefix_cache()  # with the key, everything works: the reset happens
            deadline = time.monotonic() + 30
            while ((await good.get_stats())["num_cached_device_blocks"]
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.05)
            assert (await good.get_stats())["num_cached_device_blocks"] == 0

    with engine(tiny_llama_dir, address, tmp_path / "engine.log", "--curve-keys", str(keys[0]),
                client_keys=keys[1]) as server:
        run(main())
        assert "WITHOUT authentication" not in server.log()


def test_engine_on_tcp_without_keys_warns_loudly(tiny_llama_dir: Path, tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with engine(tiny_llama_dir, address, tmp_path / "engine.log") as server:
        run(wait_engine_idle(address))
        assert server.log().count("WITHOUT authentication") == 1


def test_oversized_message_is_refused_and_the_engine_serves_on(ipc_engine: tuple[Server,
                                                                                 str]) -> None:
    server, address = ipc_engine

    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            limit = client.ready.max_message_size if client.ready else 0
            assert limit > 0
            # The SDK refuses what the engine's socket would refuse, before it goes out.
            with pytest.raises(InvalidRequest, match="bytes on the wire"):
                await client.add([5] * (limit // 2), SamplingParams())  # ids as JSON: 2 bytes each
            # A raw client sends it anyway: ZeroMQ drops its connection; the engine never
            # sees the message.
            ctx = zmq.asyncio.Context()
            try:
                sock = await raw_dealer(ctx, address)
                monitor = sock.get_monitor_socket()
                sock.connect(address)
                await next_event(monitor, {zmq.EVENT_HANDSHAKE_SUCCEEDED})
                payload = orjson.dumps({"request_id": "big", "prompt_token_ids": [5] * (limit // 2),
                                        "params": SamplingParams().to_dict()})
                assert len(payload) > limit
                await sock.send_multipart([P.MsgType.ADD.value, payload])
                await next_event(monitor, {zmq.EVENT_DISCONNECTED})
                sock.disable_monitor()
            finally:
                ctx.destroy(linger=0)
            # The engine serves on: this client's connection and a new one.
            outs = await collect(await client.add([5, 6],
                                                  SamplingParams(max_tokens=3, temperature=0.0)))
            assert outs[-1].finished
        stats = await wait_engine_idle(address)
        assert is_idle(stats)

    run(main())
    assert server.proc is not None and server.proc.poll() is None


def test_a_flood_waits_for_later_steps_and_is_all_answered(ipc_engine: tuple[Server, str]) -> None:
    _, address = ipc_engine
    n = 4 * MAX_DRAIN_PER_STEP + 17

    async def main() -> None:
        async with AsyncEngineClient(address) as client:
            stream = await client.add([5, 6, 7], LONG)
            first = await stream.__anext__()
            ctx = zmq.asyncio.Context()
            try:
                flood = await raw_dealer(ctx, address)
                flood.connect(address)

                async def send() -> None:
                    for _ in range(n):
                        await flood.send_multipart(P.encode(P.GetStats()))

                async def receive() -> list[float]:
                    steps = []
                    for _ in range(n):
                        msg = P.decode(await flood.recv_multipart())
                        assert isinstance(msg, P.Stats)
                        steps.append(msg.gauges["num_steps"])
                    return steps

                _, steps = await asyncio.gather(send(), receive())
            finally:
                ctx.destroy(linger=0)
            rest = await collect(stream)
        # Every flood message was answered, and steps went on between them: at most
        # MAX_DRAIN_PER_STEP were taken between two steps, so the answers span at least n //
        # MAX_DRAIN_PER_STEP steps.
        assert len(steps) == n and steps == sorted(steps)
        assert len(set(steps)) >= n // MAX_DRAIN_PER_STEP, sorted(set(steps))
        # the request was still running during the flood
        assert steps[-1] < steps[0] + LONG.max_tokens
        tokens = first.new_token_ids + [t for o in rest for t in o.new_token_ids]
        assert len(tokens) == LONG.max_tokens and rest[-1].finish_reason == "length"

    run(main())


def test_a_frozen_engine_is_noticed_within_the_timeout(ipc_engine: tuple[Server, str]) -> None:
    """Silence past engine_timeout is the engine-lost path: without resume the request fails with
    EngineDead; with resume (the default) it is held, and once the engine wakes it is resubmitted
    and ends with exactly the tokens of an uninterrupted run."""
    server, address = ipc_engine

    async def main() -> None:
        async with AsyncEngineClient(address, engine_timeout=2.0, resume_timeout=0) as client:
            reference = [t for o in await collect(await client.add([5, 6, 7], LONG))
                         for t in o.new_token_ids]
            stream = await client.add([5, 6, 7], LONG)
            await stream.__anext__()
            os.kill(server.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(EngineDead, match="sent nothing for"):
                    await asyncio.wait_for(collect(stream), 60)
                assert time.monotonic() - start < 30
            finally:
                os.kill(server.pid, signal.SIGCONT)
            # It was only frozen: the client greets it again, and the abort sent on silence
            # freed the request.
            deadline = time.monotonic() + 30
            while not client.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            outs = await collect(await client.add([5],
                                                  SamplingParams(max_tokens=3, temperature=0.0)))
            assert outs[-1].finished
        assert is_idle(await wait_engine_idle(address))
        async with AsyncEngineClient(address, engine_timeout=2.0) as client:
            stream = await client.add([5, 6, 7], LONG)
            first = await stream.__anext__()
            os.kill(server.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 30
                while client.connected and time.monotonic() < deadline:  # noticed: held, not failed
                    await asyncio.sleep(0.05)
                assert not client.connected
            finally:
                os.kill(server.pid, signal.SIGCONT)
            rest = await asyncio.wait_for(collect(stream), 60)
            assert first.new_token_ids + [t for o in rest for t in o.new_token_ids] == reference
        assert is_idle(await wait_engine_idle(address))

    run(main())


def test_heartbeats_come_while_a_request_streams_nothing(tiny_llama_dir: Path,
                                                         tmp_path: Path) -> None:
    """best_of > n sends nothing until the end: only the engine's heartbeats say it is
    alive meanwhile."""
    address = f"ipc://{tmp_path}/engine.sock"

    async def main() -> list[P.Message]:
        ctx = zmq.asyncio.Context()
        try:
            sock = await raw_dealer(ctx, address)
            sock.connect(address)
            await sock.send_multipart(P.encode(P.Hello()))
            ready = P.decode(await sock.recv_multipart())
            assert isinstance(ready, P.Ready) and ready.heartbeat_interval == 0.05
            params = SamplingParams(max_tokens=300, n=1, best_of=2, ignore_eos=True, seed=1)
            await sock.send_multipart(P.encode(P.Add("quiet", [5, 6, 7], params)))
            received: list[P.Message] = []
            while not (received and isinstance(received[-1], P.Outputs)
                       and received[-1].outputs[-1].finished):
                received.append(P.decode(await sock.recv_multipart()))
            return received
        finally:
            ctx.destroy(linger=0)

    with engine(tiny_llama_dir, address, tmp_path / "engine.log", "--heartbeat-interval", "0.05"):
        received = run(main())
    assert all(isinstance(m, P.Heartbeat)
               for m in received[:-1]) and len(received) >= 2, received[:3]


def test_a_reconnection_under_a_routing_identity_the_engine_still_holds_is_answered(
        ipc_engine: tuple[Server, str]) -> None:
    """What a freeze past ZeroMQ's heartbeat leaves behind, made deterministic: the client's
    dropped connection comes back under the same identity while the engine still holds the old one.
    The engine hands the identity over to the new connection (ROUTER_HANDOVER): its HELLO is
    answered, and so are its requests. (Without the handover ZeroMQ ignores the newcomer and the
    client waits for good.)"""
    _, address = ipc_engine

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            hello = P.encode(P.Hello())
            socks = []
            for _ in range(2):  # the second connects while the first is still there
                sock = await raw_dealer(ctx, address)
                sock.setsockopt(zmq.IDENTITY, b"twin")
                sock.connect(address)
                await sock.send_multipart(hello)
                socks.append(sock)
                frames = await asyncio.wait_for(sock.recv_multipart(), 30)
                assert isinstance(P.decode(frames), P.Ready)
            add = P.Add("after-handover", [5, 6], SamplingParams(max_tokens=3, temperature=0.0))
            await socks[1].send_multipart(P.encode(add))
            outs: list[P.RequestOutput] = []
            while not (outs and outs[-1].finished):
                msg = P.decode(await asyncio.wait_for(socks[1].recv_multipart(), 30))
                if isinstance(msg, P.Outputs):
                    outs += msg.outputs
            assert sum(len(o.new_token_ids) for o in outs) == 3
        finally:
            ctx.destroy(linger=0)

    run(main())


def test_a_hello_with_a_string_protocol_version_is_refused_by_type(ipc_engine: tuple[Server,
                                                                                     str]) -> None:
    _, address = ipc_engine

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            sock = await raw_dealer(ctx, address)
            sock.connect(address)
            await sock.send_multipart(P.encode(P.Hello(protocol_version="4")))  # type: ignore[arg-type]
            answer = P.decode(await asyncio.wait_for(sock.recv_multipart(), 30))
            assert isinstance(answer, P.Error) and answer.status == 400
            expected = "protocol_version must be an integer, got str '4'"
            assert answer.message == expected, answer.message
        finally:
            ctx.destroy(linger=0)

    run(main())
