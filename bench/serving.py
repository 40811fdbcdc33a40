"""Serving benchmark: an OpenAI-API load generator, and the gateway's own streaming capacity.

Load generator, against any running server (Conveyor, vLLM, ...):
    python bench/serving.py load --url http://127.0.0.1:8000 --rates 1,2,4 --num-requests 64
    python bench/serving.py load --url http://127.0.0.1:8000 --concurrency 16
Poisson arrivals at each rate (requests/s), or a fixed number of requests in flight. Prints throughput,
TTFT p50/p99 and inter-token latency p50/p99 (gaps between streamed events).

Gateway capacity, self-contained (starts its own servers on a tiny random model, so the engine is not the
bottleneck):
    python bench/serving.py gateway [--clients 256] [--max-tokens 400]
Measures how many tokens/s one gateway process streams to N concurrent SSE clients, what two gateway
workers add, and the engine's step time with all N requests consumed by a single SDK client versus
streamed to N SSE clients through the gateway (the process split should keep the two equal).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import orjson  # noqa: E402


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
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


# -- the load generator --------------------------------------------------------------------------------


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, parse_events: bool) -> Result:
    """Streams one completion. parse_events=False reads raw bytes and parses only the final usage event
    (cheap enough for hundreds of clients on the same machine as the server)."""
    res, t0 = Result(), time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"{resp.status}: {(await resp.text())[:200]}"
                return res
            last, tail = None, b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                elif parse_events:
                    res.gaps.append(now - last)
                last = now
                res.events += chunk.count(b"data: ")
                tail = (tail + chunk)[-4096:]
        usage = tail.rsplit(b"data: ", 2)[-2].strip()  # the event before [DONE]
        res.completion_tokens = orjson.loads(usage)["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - t0
        res.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def make_body(rng: random.Random, args: argparse.Namespace) -> dict:
    prompt = [rng.randrange(100, args.prompt_vocab) for _ in range(rng.randint(*args.prompt_len))]
    return {"model": args.model, "prompt": prompt, "max_tokens": rng.randint(*args.output_len), "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def run_load(url: str, bodies: list[dict], rate: float | None, concurrency: int | None,
                   parse_events: bool = True) -> tuple[list[Result], float]:
    rng = random.Random(0)
    sem = asyncio.Semaphore(concurrency or len(bodies))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def fire(body: dict) -> Result:
            async with sem:
                return await one_request(session, url, body, parse_events)

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
    row = {"requests": len(ok), "failed": len(results) - len(ok), "req_s": len(ok) / elapsed, "tok_s": tokens / elapsed,
           "ttft_p50": pct([r.ttft for r in ok], 50), "ttft_p99": pct([r.ttft for r in ok], 99),
           "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99)}
    print(f"{label:<22} {row['requests']:>5} ok {row['failed']:>3} failed  {row['req_s']:7.2f} req/s "
          f"{row['tok_s']:9.0f} tok/s  TTFT p50 {row['ttft_p50'] * 1e3:7.1f} ms p99 {row['ttft_p99'] * 1e3:7.1f} ms  "
          f"ITL p50 {row['itl_p50'] * 1e3:6.1f} ms p99 {row['itl_p99'] * 1e3:6.1f} ms", flush=True)
    errors = {r.error for r in results if not r.ok}
    if errors:
        print(f"  errors: {sorted(errors)[:3]}")
    return row


def cmd_load(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    bodies = [make_body(rng, args) for _ in range(args.num_requests)]
    if args.concurrency:
        results, elapsed = asyncio.run(run_load(args.url, bodies, None, args.concurrency))
        report(f"concurrency {args.concurrency}", results, elapsed)
    for rate in args.rates:
        results, elapsed = asyncio.run(run_load(args.url, bodies, rate, None))
        report(f"rate {rate:g} req/s", results, elapsed)


# -- gateway capacity ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_model(folder: Path) -> Path:
    """A 1-layer random Llama with SmolLM2's tokenizer; vocab cut to 4096 ids (all ordinary BPE tokens)
    so that a step of 256 sequences costs the engine about a millisecond."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.15)
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer(resolve_model("SmolLM2-135M-Instruct")).save_pretrained(folder)
    return folder


class Proc:
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, text=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_ready(url: str, timeout: float = 180) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def gateway_pids(server_pid: int) -> list[int]:
    """The gateway processes of a `conveyor serve`: itself and its `gateway` worker children."""
    pids = [server_pid]
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"\0gateway\0gateway\0" in c.read():
                        pids.append(int(child))
    return pids


async def step_time_while(address: str, work: asyncio.Future) -> float:
    """Mean engine step time (s) over the middle of `work`, from the engine's step counter."""
    from shared.client import AsyncEngineClient

    samples = []
    async with AsyncEngineClient(address, name="bench-stats") as client:
        while not work.done():
            stats = await client.get_stats()
            samples.append((time.perf_counter(), stats.get("num_steps", 0), stats.get("num_running", 0)))
            await asyncio.sleep(0.2)
    busy = [s for s in samples if s[2] > 0]
    busy = busy[len(busy) // 4: len(busy) * 3 // 4 + 1] or busy  # steady state: not ramp-up or drain
    if len(busy) < 2 or busy[-1][1] == busy[0][1]:
        return float("nan")
    return (busy[-1][0] - busy[0][0]) / (busy[-1][1] - busy[0][1])


async def sdk_consumer(address: str, bodies: list[dict]) -> tuple[float, float]:
    """All requests through ONE SDK client, token-level: the engine's pace without any gateway."""
    from shared.client import AsyncEngineClient
    from shared.sampling import SamplingParams

    async with AsyncEngineClient(address, name="bench-sdk") as client:
        async def one(body: dict) -> int:
            stream = await client.add(body["prompt"], SamplingParams(max_tokens=body["max_tokens"], temperature=0,
                                                                     ignore_eos=True))
            return sum([len(o.new_token_ids) async for o in stream])

        t0 = time.perf_counter()
        work = asyncio.gather(*[one(b) for b in bodies])
        step = await step_time_while(address, work)
        tokens = sum(await work)
        return tokens / (time.perf_counter() - t0), step


async def sse_clients(url: str, address: str | None, bodies: list[dict]) -> tuple[list[Result], float, float]:
    work = asyncio.ensure_future(run_load(url, bodies, None, None, parse_events=False))
    step = await step_time_while(address, work) if address else float("nan")
    results, elapsed = await work
    return results, elapsed, step


def fake_engine(address: str, step_interval: float) -> None:
    """A paced stand-in for the engine (run in its own process): every step_interval each live request
    gets one token, until its max_tokens. It costs next to nothing, so the gateway alone is measured."""
    import zmq

    from shared import protocol as P

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(address)
    live: dict[str, list] = {}  # request id -> [client, prompt len, max tokens, sent]
    next_step = time.perf_counter()
    while True:
        while sock.poll(0 if live else 100):
            ident, *frames = sock.recv_multipart()
            msg = P.decode(frames)
            if isinstance(msg, P.Hello):
                sock.send_multipart([ident, *P.encode(P.Ready(P.PROTOCOL_VERSION, "fake", 4096, [2]))])
            elif isinstance(msg, P.GetStats):
                sock.send_multipart([ident, *P.encode(P.Stats({"num_running": float(len(live))}))])
            elif isinstance(msg, P.Add):
                live[msg.request_id] = [ident, len(msg.prompt_token_ids), msg.params.max_tokens, 0]
            elif isinstance(msg, P.Abort):
                for rid in msg.request_ids:
                    live.pop(rid, None)
        now = time.perf_counter()
        if not live or now < next_step:
            time.sleep(max(0.0, min(next_step - now, 0.001)))
            continue
        next_step = max(next_step + step_interval, now)
        by_client: dict[bytes, list] = {}
        for rid, entry in list(live.items()):
            entry[3] += 1
            done = entry[3] >= entry[2]
            by_client.setdefault(entry[0], []).append(
                P.RequestOutput(rid, [300 + entry[3] % 3000], done, "length" if done else None, entry[1]))
            if done:
                del live[rid]
        for ident, outs in by_client.items():
            sock.send_multipart([ident, *P.encode(P.Outputs(outs))])


def serve(argv: list[str], env: dict[str, str], url: str) -> Proc:
    server = Proc(argv, env)
    try:
        wait_ready(url)
    except BaseException:
        server.stop()
        raise
    return server


def measure_sse(url: str, address: str | None, bodies: list[dict], pids: list[int], label: str) -> dict[str, float]:
    asyncio.run(run_load(url, bodies[:8], None, None, parse_events=False))  # warm-up
    cpu0 = cpu_seconds(pids)
    results, elapsed, step = asyncio.run(sse_clients(url, address, bodies))
    cpu = cpu_seconds(pids) - cpu0
    row = report(label, results, elapsed)
    tokens = sum(r.completion_tokens for r in results if r.ok)
    row.update(step=step, events_s=sum(r.events for r in results) / elapsed, tok_per_cpu_s=tokens / cpu if cpu else 0)
    print(f"  {row['events_s']:.0f} events/s; gateway CPU {cpu:.1f} s = {row['tok_per_cpu_s']:.0f} tokens per "
          f"gateway CPU-second" + (f"; engine step {step * 1e3:.2f} ms" if address else ""), flush=True)
    return row


def cmd_gateway(args: argparse.Namespace) -> None:
    import multiprocessing

    from bench.common import machine

    tmp = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    env = {**os.environ, "CONVEYOR_CACHE": os.environ.get("CONVEYOR_CACHE", str(tmp / "cache"))}
    os.environ.update(env)
    model = build_tiny_model(tmp / "tiny")
    conveyor = str(Path(sys.executable).with_name("conveyor"))
    rng = random.Random(args.seed)
    bodies = [{"prompt": [rng.randrange(100, 4096) for _ in range(16)], "max_tokens": args.max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
              for _ in range(args.clients)]
    common = ["--stream-interval", str(args.stream_interval), "--max-concurrent-requests", str(2 * args.clients)]
    print(f"machine: {machine()}")
    print(f"{args.clients} SSE clients x {args.max_tokens} tokens, --stream-interval {args.stream_interval}")
    rows: dict[str, dict[str, float]] = {}
    try:
        print("\n== tiny random model (1 layer, hidden 64, vocab 4096) ==")
        for workers in (1, 2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            server = serve([conveyor, "serve", "--model", str(model), "--port", str(port), "--num-threads", "1",
                            "--max-num-seqs", str(max(256, args.clients)), "--max-num-batched-tokens", "1024",
                            "--kv-cache-memory", "256MiB", "--gateway-workers", str(workers), *common], env, url)
            try:
                address = f"ipc:///tmp/conveyor-{server.proc.pid}.sock"
                if workers == 1:
                    tok_s, step = asyncio.run(sdk_consumer(address, bodies))
                    print(f"{len(bodies)} requests on 1 SDK client (no gateway): {tok_s:9.0f} tok/s, engine step "
                          f"{step * 1e3:.2f} ms", flush=True)
                    rows["sdk"] = {"tok_s": tok_s, "step": step}
                rows[f"tiny-{workers}"] = measure_sse(url, address, bodies, gateway_pids(server.proc.pid),
                                                      f"{workers} gateway worker(s)")
            finally:
                server.stop()
        print(f"\n== paced fake engine (one token per request every {args.fake_step_ms:g} ms: the gateway alone) ==")
        engine_address = f"tcp://127.0.0.1:{free_port()}"
        fake = multiprocessing.get_context("spawn").Process(target=fake_engine,
                                                            args=(engine_address, args.fake_step_ms / 1e3), daemon=True)
        fake.start()
        try:
            for workers in (1, 2):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                server = serve([conveyor, "serve", "--engine-address", engine_address, "--model", str(model),
                                "--port", str(port), "--gateway-workers", str(workers), *common], env, url)
                try:
                    rows[f"fake-{workers}"] = measure_sse(url, None, bodies, gateway_pids(server.proc.pid),
                                                          f"{workers} gateway worker(s)")
                finally:
                    server.stop()
        finally:
            fake.terminate()
        print("\n== summary ==")
        for kind in ("tiny", "fake"):
            one, two = rows[f"{kind}-1"], rows[f"{kind}-2"]
            print(f"{kind:>4} engine: one gateway process streams {one['tok_s']:7.0f} tok/s to {args.clients} SSE "
                  f"clients ({one['tok_per_cpu_s']:.0f} per gateway CPU-second; target 20000); two workers: "
                  f"{two['tok_s']:7.0f} tok/s")
        print(f"engine step with {args.clients} requests: {rows['sdk']['step'] * 1e3:.2f} ms with 1 client (SDK) vs "
              f"{rows['tiny-1']['step'] * 1e3:.2f} ms with {args.clients} SSE clients through one gateway")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="OpenAI-API load against a running server")
    load.add_argument("--url", default="http://127.0.0.1:8000")
    load.add_argument("--model", default=None, help="the model name to send (default: none, the server's)")
    load.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                      help="Poisson arrival rates, requests/s, comma-separated")
    load.add_argument("--concurrency", type=int, default=None, help="fixed number of requests in flight")
    load.add_argument("--num-requests", type=int, default=64)
    load.add_argument("--prompt-len", type=lambda s: tuple(int(x) for x in s.split(",")), default=(32, 256),
                      help="min,max prompt tokens")
    load.add_argument("--output-len", type=lambda s: tuple(int(x) for x in s.split(",")), default=(16, 128),
                      help="min,max output tokens")
    load.add_argument("--prompt-vocab", type=int, default=4096, help="prompt token ids are drawn below this")
    load.add_argument("--seed", type=int, default=0)
    gw = sub.add_parser("gateway", help="the gateway's streaming capacity on a tiny model (starts its own servers)")
    gw.add_argument("--clients", type=int, default=256)
    gw.add_argument("--max-tokens", type=int, default=400)
    gw.add_argument("--stream-interval", type=int, default=1)
    gw.add_argument("--fake-step-ms", type=float, default=5.0, help="the fake engine's step interval")
    gw.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.command == "load":
        if not args.rates and not args.concurrency:
            p.error("give --rates and/or --concurrency")
        cmd_load(args)
    else:
        cmd_gateway(args)


if __name__ == "__main__":
    main()
