"""Serving benchmark: an OpenAI-API load generator, and the gateway's own streaming capacity.

Load generator, against any running server (Conveyor, vLLM, ...):
    python bench/serving.py load --url http://127.0.0.1:8000 --rates 1,2,4 --num-requests 64
    python bench/serving.py load --url http://127.0.0.1:8000 --concurrency 16
Poisson arrivals at each rate (requests/s), or a fixed number of requests in flight. Prints
throughput, TTFT p50/p99 and inter-token latency p50/p99 (the gaps between reads that bring SSE
events).

Each client is its own HTTP/1.1 connection (`Connection: close`) whose response is read as raw bytes
by an asyncio.Protocol: one callback per read that counts events and keeps the tail, where the usage
event is. A client library that parses every event (aiohttp's client took about 50 us per event
here) would need as much CPU as the gateway it measures, and on a small machine they share the
cores.

Gateway capacity, self-contained (starts its own servers on a tiny random model; see
bench/gateway_capacity.py):
    python bench/serving.py gateway [--clients 256] [--max-tokens 400] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import orjson
import uvloop

NAN = float("nan")


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    events: int = 0
    latency: float = 0.0
    error: str = ""


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return NAN
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


# -- the load generator ----------------------------------------------------------------------------


class SSEReader(asyncio.Protocol):
    """One streamed completion on its own connection, which the server closes after the response."""

    def __init__(self, request: bytes, res: Result, t0: float) -> None:
        self.request, self.res, self.t0 = request, res, t0
        self.last: float | None = None
        self.head = b""  # the status line
        self.tail = b""  # the last bytes: the usage event and [DONE]
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if len(self.head) < 16:
            self.head += data[:16]
        # Every event starts a line (JSON escapes newlines); a marker split across reads counts
        # once.
        n = (self.tail[-6:] + data).count(b"\ndata: ")
        if n:
            if self.last is None:
                self.res.ttft = now - self.t0
            else:
                self.res.gaps.append(now - self.last)
            self.last = now
            self.res.events += n
        self.tail = (self.tail + data)[-2048:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def one_request(host: str, port: int, body: dict[str, Any]) -> Result:
    res, t0 = Result(), time.perf_counter()
    payload = orjson.dumps(body)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
               "Content-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    try:
        _, reader = await asyncio.get_running_loop().create_connection(
            lambda: SSEReader(request, res, t0), host, port)
        await reader.closed
        status = reader.head.split(b" ", 2)[1]
        if status != b"200":
            res.error = f"{status.decode()}: {reader.tail[-200:].decode(errors='replace')}"
        elif b"data: [DONE]" not in reader.tail[-64:]:
            res.error = "the stream ended without [DONE]"
        else:
            # the event before [DONE]
            usage = reader.tail.rsplit(b"\ndata: ", 2)[-2].split(b"\n", 1)[0]
            res.completion_tokens = orjson.loads(usage)["usage"]["completion_tokens"]
            res.latency = time.perf_counter() - t0
            res.ok = True
    except (OSError, ValueError, KeyError, IndexError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def make_body(rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    prompt = [rng.randrange(100, args.prompt_vocab) for _ in range(rng.randint(*args.prompt_len))]
    return {"model": args.model, "prompt": prompt, "max_tokens": rng.randint(*args.output_len),
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def run_load(url: str, bodies: list[dict[str, Any]], rate: float | None,
                   concurrency: int | None) -> tuple[list[Result], float]:
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    rng, sem = random.Random(0), asyncio.Semaphore(concurrency or len(bodies))

    async def fire(body: dict[str, Any]) -> Result:
        async with sem:
            return await one_request(host, port, body)

    t0, tasks = time.perf_counter(), []
    for body in bodies:
        tasks.append(asyncio.create_task(fire(body)))
        if rate:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def report(label: str, results: list[Result], elapsed: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    gaps = [g for r in ok for g in r.gaps]
    row = {"requests": len(ok), "failed": len(results) - len(ok), "req_s": len(ok) / elapsed,
           "tok_s": tokens / elapsed, "ttft_p50": pct([r.ttft for r in ok], 50),
           "ttft_p99": pct([r.ttft for r in ok], 99), "itl_p50": pct(gaps, 50),
           "itl_p99": pct(gaps, 99)}
    print(f"{label:<22} {row['requests']:>5} ok {row['failed']:>3} failed  {row['req_s']:7.2f} "
          f"req/s {row['tok_s']:9.0f} tok/s  TTFT p50 {row['ttft_p50'] * 1e3:7.1f} ms p99 "
          f"{row['ttft_p99'] * 1e3:7.1f} ms  ITL p50 {row['itl_p50'] * 1e3:6.1f} ms p99 "
          f"{row['itl_p99'] * 1e3:6.1f} ms", flush=True)
    errors = {r.error for r in results if not r.ok}
    if errors:
        print(f"  errors: {sorted(errors)[:3]}")
    return row


def cmd_load(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    bodies = [make_body(rng, args) for _ in range(args.num_requests)]
    if args.concurrency:
        results, elapsed = uvloop.run(run_load(args.url, bodies, None, args.concurrency))
        report(f"concurrency {args.concurrency}", results, elapsed)
    for rate in args.rates:
        results, elapsed = uvloop.run(run_load(args.url, bodies, rate, None))
        report(f"rate {rate:g} req/s", results, elapsed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="OpenAI-API load against a running server")
    load.add_argument("--url", default="http://127.0.0.1:8000")
    load.add_argument("--model", default=None,
                      help="the model name to send (default: none, the server's)")
    load.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                      help="Poisson arrival rates, requests/s, comma-separated")
    load.add_argument("--concurrency", type=int, default=None,
                      help="fixed number of requests in flight")
    load.add_argument("--num-requests", type=int, default=64)
    load.add_argument("--prompt-len", type=lambda s: tuple(int(x) for x in s.split(",")),
                      default=(32, 256), help="min,max prompt tokens")
    load.add_argument("--output-len", type=lambda s: tuple(int(x) for x in s.split(",")),
                      default=(16, 128), help="min,max output tokens")
    load.add_argument("--prompt-vocab", type=int, default=4096,
                      help="prompt token ids are drawn below this")
    load.add_argument("--seed", type=int, default=0)
    gw = sub.add_parser("gateway",
                        help="the gateway's streaming capacity on a tiny model (starts its own "
                             "servers)")
    gw.add_argument("--clients", type=int, default=256)
    gw.add_argument("--max-tokens", type=int, default=400)
    gw.add_argument("--stream-interval", type=int, default=1)
    gw.add_argument("--target", type=int, default=20000,
                    help="tokens/s one gateway process should stream")
    gw.add_argument("--rounds", type=int, default=3,
                    help="alternating SDK / SSE rounds with one gateway worker")
    gw.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.command == "load":
        if not args.rates and not args.concurrency:
            p.error("give --rates and/or --concurrency")
        cmd_load(args)
    else:
        from bench.gateway_capacity import cmd_gateway

        cmd_gateway(args)


if __name__ == "__main__":
    main()
