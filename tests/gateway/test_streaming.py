"""Streaming under load against a fake engine: --stream-interval, and merged deltas for a slow
reader."""
from __future__ import annotations

import asyncio
import socket

import orjson
from aiohttp.test_utils import get_port_socket

from tests.fakes import FakeEngine, smollm2_tokenizer
from tests.gateway.test_routes import gateway, run, sse_events


def test_stream_interval_sends_first_token_at_once_then_every_n() -> None:
    ids = smollm2_tokenizer().encode(" one two three four five six seven eight nine ten eleven "
                                     "twelve thirteen")
    assert len(ids) == 13

    async def main() -> None:
        with FakeEngine(tokens=ids) as eng:
            async with gateway(eng, stream_interval=4) as http:
                resp = await http.post("/v1/completions",
                                       json={"prompt": "count", "max_tokens": 50, "stream": True})
                events = sse_events(await resp.read())
        chunks = [orjson.loads(e) for e in events[:-1]]
        texts = [c["choices"][0]["text"] for c in chunks]
        # Unloaded this is [" one", " two three four five", " six seven eight nine", " ten eleven
        # twelve thirteen"]; a busy gateway may merge deltas that piled up, so events only grow.
        assert "".join(texts) == (" one two three four five six seven eight nine ten eleven twelve"
                                  " thirteen")
        assert texts[0].startswith(" one") and len(texts) <= 4
        # only the last may hold fewer than N
        assert all(len(t.split()) >= 4 for t in texts[1:-1]), texts
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    run(main())


def test_slow_reader_gets_merged_events_not_a_growing_queue() -> None:
    """A client that stops reading: the gateway's writes block, the engine goes on, and when the
    client reads again the deltas that piled up arrive merged into few events with all of the
    text."""
    tok = smollm2_tokenizer()
    # Enough tokens that the socket buffers (which absorb the first few hundred events) are a
    # small part.
    ids = tok.encode(" lorem ipsum dolor sit amet" * 800)[:4000]

    async def main() -> None:
        with FakeEngine(tokens=ids, step_interval=0.0005, max_model_len=8192) as eng:
            async with gateway(eng, socket_factory=_small_send_buffer) as http:
                # A reader that does not read. Its receive buffer stays the kernel's default: one
                # set below the loopback MSS (64 KiB) stalled the reads at the end on 200 ms
                # window probes, 13.8 s in 1 of 5 runs here and past the test's 60 s once in CI.
                sock = socket.socket()
                sock.connect(("127.0.0.1", http.port))
                body = orjson.dumps({"prompt": "go", "max_tokens": len(ids), "stream": True})
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\n" b"Connection: close\r\nContent-Length: "
                                                     b"%d\r\n\r\n%s" % (len(body), body))
                # the request has reached the engine and the engine is done with it
                assert await asyncio.to_thread(eng.wait_for,
                                               lambda: bool(eng.adds()) and not eng._live, 20)
                raw = await asyncio.to_thread(_read_all, sock)
        head, _, body_raw = raw.partition(b"\r\n\r\n")
        assert b"200 OK" in head
        data = _dechunk(body_raw)
        events = sse_events(data)
        chunks = [orjson.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == tok.decode(ids) and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len(chunks) < len(ids) // 2, \
            f"{len(chunks)} events for {len(ids)} tokens: nothing was merged"
    run(main())


def _small_send_buffer(host: str, port: int, family: socket.AddressFamily) -> socket.socket:
    """The gateway's listening socket with a fixed small send buffer, which its connections inherit:
    left to autotune, the kernel took in 2,000 to 2,400 of the 4,000 events before a write blocked,
    in 2 of 3 runs."""
    sock = get_port_socket(host, port, family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    parts = []
    while data := sock.recv(65536):
        parts.append(data)
    sock.close()
    return b"".join(parts)


def _dechunk(body: bytes) -> bytes:
    """HTTP/1.1 chunked transfer encoding -> the bytes."""
    out, i = list[bytes](), 0
    while True:
        j = body.index(b"\r\n", i)
        size = int(body[i:j], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[j + 2:j + 2 + size])
        i = j + 2 + size + 2


def test_the_one_loop_sends_a_choices_first_output_and_first_text_at_once_then_every_n() -> None:
    """gateway/choice_stream.py, which chat, completions, Responses and Messages all render: per
    choice, its first output (the role chunk) and its first text go out at once, then every N of
    its tokens, and its last; each choice counts its own tokens."""
    from collections.abc import AsyncGenerator

    from gateway.choice_stream import ChoiceStream
    from gateway.openai_schema import ParsedRequest
    from shared.choices import TextOutput
    from shared.sampling import SamplingParams

    script = [(0, ""), (1, ""), (0, "a"), (0, "b"), (1, "x"), (0, "c"), (0, "d"), (1, "y"),
              (0, "e")]

    async def outputs() -> AsyncGenerator[TextOutput, None]:
        for k, (index, text) in enumerate(script):
            last = k == len(script) - 1 or all(i != index for i, _ in script[k + 1:])
            finish = "stop" if last else None
            yield TextOutput("r", text, [k], k == len(script) - 1, finish, 3, k + 1, index=index)

    async def main() -> list[tuple[int, bool, str, str | None]]:
        req = ParsedRequest([1], SamplingParams(n=2), True, False)
        return [(d.index, d.first, d.text, d.out.finish_reason)
                async for d in ChoiceStream(req, outputs(), 3, chat=True).deltas()]

    assert asyncio.run(main()) == [
        (0, True, "", None), (1, True, "", None),  # the first outputs, held back: the role chunks
        (0, False, "a", None),  # the first text
        (1, False, "x", None),
        (0, False, "bcd", None),  # then every 3 of its tokens
        (1, False, "y", "stop"),  # and its last
        (0, False, "e", "stop"),
    ]
