"""The gateway's streaming capacity: `python bench/serving.py gateway` (its flags: --help there).

1. A tiny random Llama with SmolLM2's tokenizer (1 layer, hidden 64, one KV head; its vocabulary is
   the tokenizer's first 4096 ids, ordinary BPE tokens, so every id it emits is a real token the
   gateway detokenizes) serves N requests of max_tokens each, greedy, so that the engine is not the
   bottleneck:
   a. all N through ONE SDK client (token-level, no gateway): the engine at its own pace;
   b. the same N as N concurrent SSE clients of one gateway process (rounds alternate a and b, so
      that a busy machine slows both alike), then of two gateway workers.
   Tokens/s counts the completion tokens the clients received (their usage events) over the whole
   run. With --stream-interval 1 a gateway that falls behind the engine sends the tokens that
   arrived meanwhile in one event, so events/s and tokens per event are printed too.
   "A step of the engine gets no slower with N streaming clients connected than with 1" is read as:
   the same engine load (N running sequences, the same prompts and lengths) consumed by one client
   (a) or by N HTTP clients through the gateway (b). The step time is the engine's own (STATS
   total_step_seconds over num_steps) while all N requests run; next to it is the engine process's
   CPU time per step, which tells a step that got slower from one that waited for a core. The engine
   runs one compute thread, which OpenMP binds to one core; `conveyor serve` keeps its gateway
   processes off that core when others are left (gateway/launcher.py), and the load generator keeps
   off it too. On a 2-core machine the gateway and the load generator then share the other core.
2. Diagnostic, not the measured target: a paced stand-in for the engine offers --target tokens/s,
   one token per request per step, so the gateway's own CPU per event shows at one token per event.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench.serving import NAN, Result, report, run_load
from gateway.launcher import keep_off_engine_cpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_tiny_model(folder: Path) -> Path:
    """A 1-layer random Llama with SmolLM2's tokenizer; the vocabulary cut to its first 4096 ids
    (ordinary BPE tokens) and one KV head, so that the LM head and the KV reads of 256 sequences
    stay small."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True, initializer_range=0.15)
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer(resolve_model("SmolLM2-135M-Instruct")).save_pretrained(folder)
    return folder


class Server:
    """`conveyor serve` (or a gateway on a given engine) until stop(); its log goes to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], url: str, log: Path) -> None:
        self.url, self.log = url, log
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                                     start_new_session=True)
        deadline = time.monotonic() + 180
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as resp:
                status: int = resp.status
                return status == 200
        except OSError:
            return False

    def children(self, marker: bytes) -> list[int]:
        """Child processes whose NUL-separated command line contains marker."""
        pids = []
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                for child in f.read().split():
                    with open(f"/proc/{child}/cmdline", "rb") as c:
                        if marker in c.read():
                            pids.append(int(child))
        return pids

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


async def engine_while(address: str, engine_pid: int | None, work: asyncio.Future[Any],
                       n: int) -> dict[str, float]:
    """The engine's figures per step while all n requests run (the same engine load whoever consumes
    it): step = time inside EngineCore.step, loop = wall time between steps, cpu = engine process
    CPU time."""
    from shared.client import AsyncEngineClient

    samples = []
    async with AsyncEngineClient(address, name="bench-stats") as client:
        while not work.done():
            s = await client.get_stats()
            cpu = cpu_seconds([engine_pid]) if engine_pid else NAN
            samples.append((time.perf_counter(), s["num_steps"], s.get("total_step_seconds", NAN),
                            cpu, s["num_running"]))
            await asyncio.sleep(0.1)
    full = [x for x in samples if x[4] == n]
    if len(full) < 2 or full[-1][1] == full[0][1]:
        return {"step": NAN, "loop": NAN, "cpu": NAN}
    (t0, n0, s0, c0, _), (t1, n1, s1, c1, _) = full[0], full[-1]
    return {"step": (s1 - s0) / (n1 - n0), "loop": (t1 - t0) / (n1 - n0),
            "cpu": (c1 - c0) / (n1 - n0)}


async def sdk_run(address: str, engine_pid: int, bodies: list[dict[str, Any]]) -> dict[str, float]:
    """All requests through ONE SDK client, token-level: the engine's pace without any gateway."""
    from shared.client import AsyncEngineClient
    from shared.sampling import SamplingParams

    async with AsyncEngineClient(address, name="bench-sdk") as client:
        async def one(body: dict[str, Any]) -> int:
            params = SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=True)
            return sum([len(o.new_token_ids) async
                        for o in await client.add(body["prompt"], params)])

        t0 = time.perf_counter()
        work = asyncio.gather(*[one(b) for b in bodies])
        engine = await engine_while(address, engine_pid, work, len(bodies))
        tokens = sum(await work)
        return {"tok_s": tokens / (time.perf_counter() - t0), **engine}


async def sse_run(url: str, address: str, engine_pid: int | None,
                  bodies: list[dict[str, Any]]) -> tuple[list[Result], float, dict[str, float]]:
    work = asyncio.ensure_future(run_load(url, bodies, None, None))
    engine = await engine_while(address, engine_pid, work, len(bodies))
    results, elapsed = await work
    return results, elapsed, engine


def measure_sse(server: Server, address: str, engine_pid: int | None, bodies: list[dict[str, Any]],
                label: str) -> dict[str, float]:
    uvloop.run(run_load(server.url, bodies[:8], None, None))  # warm-up
    pids = [server.proc.pid, *server.children(b"\0gateway\0gateway\0")]
    cpu0, me0 = cpu_seconds(pids), time.process_time()
    results, elapsed, engine = uvloop.run(sse_run(server.url, address, engine_pid, bodies))
    cpu, me = cpu_seconds(pids) - cpu0, time.process_time() - me0
    row = report(label, results, elapsed)
    tokens = sum(r.completion_tokens for r in results if r.ok)
    events = sum(r.events for r in results if r.ok)
    row.update(engine, events_s=events / elapsed, tok_per_event=tokens / max(events, 1),
               tok_per_cpu_s=tokens / cpu if cpu else NAN,
               events_per_cpu_s=events / cpu if cpu else NAN)
    print(f"  {row['events_s']:.0f} events/s, {row['tok_per_event']:.2f} tokens per event; gateway "
          f"CPU {cpu:.1f} s = {row['tok_per_cpu_s']:.0f} tokens, {row['events_per_cpu_s']:.0f} "
          f"events per gateway CPU-second; load generator CPU {me:.1f} s", flush=True)
    if engine_pid:
        print(f"  engine while all {len(bodies)} run: {fmt_engine(row)}", flush=True)
    return row


def fmt_engine(row: dict[str, float]) -> str:
    return (f"step {row['step'] * 1e3:.2f} ms, engine CPU {row['cpu'] * 1e3:.2f} ms per step, "
            f"{row['loop'] * 1e3:.2f} ms between steps")


@dataclass
class FakeRequest:
    """One live request of the paced stand-in."""

    client: bytes
    prompt_len: int
    max_tokens: int
    sent: int = 0


def fake_engine(address: str, step_interval: float) -> None:
    """A paced stand-in for the engine (run in its own process): every step_interval each live
    request gets one token, until its max_tokens. It costs next to nothing, so the gateway alone is
    measured."""
    import zmq

    from shared import protocol as P

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(address)
    live: dict[str, FakeRequest] = {}
    steps, next_step = 0, time.perf_counter()
    while True:
        while sock.poll(0 if live else 100):
            ident, *frames = sock.recv_multipart()
            msg = P.decode(frames)
            if isinstance(msg, P.Hello):
                sock.send_multipart([ident,
                                     *P.encode(P.Ready(P.PROTOCOL_VERSION, "fake", 4096))])
            elif isinstance(msg, P.GetStats):
                sock.send_multipart([ident, *P.encode(P.Stats({"num_running": len(live),
                                                               "num_steps": steps}))])
            elif isinstance(msg, P.Add):
                live[msg.request_id] = FakeRequest(ident, len(msg.prompt_token_ids),
                                                   msg.params.max_tokens)
            elif isinstance(msg, P.Abort):
                for rid in msg.request_ids:
                    live.pop(rid, None)
        now = time.perf_counter()
        if not live or now < next_step:
            time.sleep(max(0.0, min(next_step - now, 0.001)))
            continue
        next_step, steps = max(next_step + step_interval, now), steps + 1
        by_client: dict[bytes, list[P.RequestOutput]] = {}
        for rid, req in list(live.items()):
            req.sent += 1
            done = req.sent >= req.max_tokens
            by_client.setdefault(req.client, []).append(
                P.RequestOutput(rid, [300 + req.sent % 3000], done, "length" if done else None,
                                num_prompt_tokens=req.prompt_len))
            if done:
                del live[rid]
        for ident, outs in by_client.items():
            sock.send_multipart([ident, *P.encode(P.Outputs(outs))])


def cmd_gateway(args: argparse.Namespace) -> None:
    from bench.common import machine

    tmp = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    env = {**os.environ, "CONVEYOR_CACHE": os.environ.get("CONVEYOR_CACHE", str(tmp / "cache"))}
    os.environ.update(env)
    model = build_tiny_model(tmp / "tiny")
    gc.freeze()  # transformers is loaded here too: full collections would stall the load generator
    rng = random.Random(args.seed)
    bodies = [{"prompt": [rng.randrange(100, 4096) for _ in range(16)],
               "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for _ in range(args.clients)]
    print(f"machine: {machine()}; engine, gateway and load generator share it")
    print(f"{args.clients} clients x {args.max_tokens} tokens, greedy, --stream-interval "
          f"{args.stream_interval}")
    try:
        rows = tiny_engine_runs(args, model, bodies, env, tmp)
        rows.update(paced_engine_runs(args, model, bodies, env, tmp))
        summary(rows, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        # let exit collect it (nanobind, under triton, reports what is not collected as leaks)
        gc.unfreeze()


def serve_argv(args: argparse.Namespace, port: int, workers: int, *more: str) -> list[str]:
    return [str(Path(sys.executable).with_name("conveyor")), "serve", "--port", str(port),
            "--gateway-workers", str(workers), "--stream-interval", str(args.stream_interval),
            "--max-concurrent-requests", str(2 * args.clients), *more]


def tiny_engine_runs(args: argparse.Namespace, model: Path, bodies: list[dict[str, Any]],
                     env: dict[str, str], tmp: Path) -> dict[str, list[dict[str, float]]]:
    """Rounds of (one SDK client, then N SSE clients through one gateway), then one round of two
    workers."""
    print("\n== tiny random model (1 layer, hidden 64, 1 KV head, vocab 4096 of SmolLM2's "
          "tokenizer) ==")
    rows: dict[str, list[dict[str, float]]] = {}
    all_cpus = os.sched_getaffinity(0)
    for workers in (1, 2):
        port = free_port()
        server = Server(serve_argv(args, port, workers, "--model", str(model), "--num-threads", "1",
                                   "--max-num-seqs", str(max(256, args.clients)),
                                   "--max-num-batched-tokens", "1024", "--kv-cache-memory",
                                   "256MiB"), env, f"http://127.0.0.1:{port}",
                        tmp / f"serve-{workers}.log")
        try:
            address = f"ipc:///tmp/conveyor-{server.proc.pid}.sock"
            engine_pid = server.children(b"\0-m\0engine\0")[0]
            # Like the gateway (gateway/launcher.py), the load generator keeps off the engine's
            # core.
            cpus = keep_off_engine_cpus(engine_pid, [os.getpid()])
            if workers == 1:
                print(f"engine on CPUs {sorted(all_cpus - cpus) if cpus else 'all'}, gateway and "
                      f"load generator on {sorted(cpus) if cpus else 'all'}", flush=True)
            # alternate: a busy machine slows both alike
            for _ in range(args.rounds if workers == 1 else 1):
                if workers == 1:
                    sdk = uvloop.run(sdk_run(address, engine_pid, bodies))
                    rows.setdefault("sdk", []).append(sdk)
                    print(f"1 SDK client, {len(bodies)} requests {sdk['tok_s']:9.0f} tok/s (no "
                          f"gateway)\n  engine while all {len(bodies)} run: {fmt_engine(sdk)}",
                          flush=True)
                row = measure_sse(server, address, engine_pid, bodies,
                                  f"{workers} gateway worker(s)")
                rows.setdefault(f"tiny-{workers}", []).append(row)
        finally:
            server.stop()
            for tid in os.listdir("/proc/self/task"):
                os.sched_setaffinity(int(tid), all_cpus)
    return rows


def paced_engine_runs(args: argparse.Namespace, model: Path, bodies: list[dict[str, Any]],
                      env: dict[str, str], tmp: Path) -> dict[str, list[dict[str, float]]]:
    import multiprocessing

    step_ms = args.clients / args.target * 1e3
    print(f"\n== diagnostic: a paced stand-in for the engine offers {args.target} tok/s "
          f"(a token per request every {step_ms:.1f} ms): the gateway alone ==")
    address = f"tcp://127.0.0.1:{free_port()}"
    fake = multiprocessing.get_context("spawn").Process(target=fake_engine,
                                                        args=(address, step_ms / 1e3), daemon=True)
    fake.start()
    rows = {}
    try:
        for workers in (1, 2):
            port = free_port()
            server = Server(serve_argv(args, port, workers, "--engine-address", address, "--model",
                                       str(model)), env, f"http://127.0.0.1:{port}",
                            tmp / f"fake-{workers}.log")
            try:
                rows[f"fake-{workers}"] = [measure_sse(server, address, None, bodies,
                                                       f"{workers} gateway worker(s)")]
            finally:
                server.stop()
    finally:
        fake.terminate()
    return rows


def median(xs: list[float]) -> float:
    """Of the rounds that measured it (NaN: a run too short to sample the engine)."""
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if xs else NAN


def summary(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    rows = {name: {k: median([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    one, two, sdk, n = rows["tiny-1"], rows["tiny-2"], rows["sdk"], args.clients
    ratios = [f"{b['step'] / a['step']:.2f}" for a, b in zip(runs["sdk"], runs["tiny-1"])]
    print(f"\n== summary (one worker and SDK: the median of {args.rounds} rounds) ==")
    print(f"one gateway process streams {one['tok_s']:.0f} tok/s to {n} SSE clients (target "
          f"{args.target}): {one['events_s']:.0f} events/s, {one['tok_per_event']:.2f} tokens per "
          f"event; {one['tok_per_cpu_s']:.0f} tokens per gateway CPU-second")
    print(f"two gateway workers: {two['tok_s']:.0f} tok/s ({two['tok_s'] / one['tok_s'] - 1:+.0%})")
    print(f"engine step with {n} requests running: {sdk['step'] * 1e3:.2f} ms with 1 client (SDK) "
          f"vs {one['step'] * 1e3:.2f} ms with {n} SSE clients through one gateway: "
          f"{one['step'] / sdk['step']:.2f}x (per round {', '.join(ratios)}); engine CPU per step "
          f"{sdk['cpu'] * 1e3:.2f} vs {one['cpu'] * 1e3:.2f} ms: {one['cpu'] / sdk['cpu']:.2f}x")
    fake = rows["fake-1"]
    print(f"gateway alone, offered {args.target} tok/s one token per event: one process delivered "
          f"{fake['tok_s']:.0f} tok/s ({fake['tok_per_event']:.2f} tokens per event) at "
          f"{fake['events_per_cpu_s']:.0f} events per gateway CPU-second; two workers "
          f"{rows['fake-2']['tok_s']:.0f} tok/s")
