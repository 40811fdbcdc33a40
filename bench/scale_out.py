"""Scale-out on one machine: data parallelism (engine replicas behind the router) and tensor
parallelism (one model over several ranks), each against its one-engine baseline measured in the
same run, through real `conveyor serve` processes over HTTP.

    python bench/scale_out.py [--num-requests 24] [--skip-tp3]

1. The same served workload (distinct random prompts, greedy, fixed lengths, a fixed number in
   flight): SmolLM2: DP=1 with 2 threads vs DP=2 with 1 thread each vs TP=3 (3 ranks of 1 thread); a
   tiny random Llama (8 heads, 4 K/V heads): TP=1 with 2 threads vs TP=2 with 1 thread each.
2. A shared-prefix workload (a few long system prompts, many questions) on DP=2: prefix-affinity
   routing vs round-robin: prefix-cache hit rate and time to first token.
3. All-reduce bytes per token per layer, counted on rank 0 of an in-process TP=2 engine.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp
import orjson

from bench.common import cpu_features, machine


@dataclass
class Result:
    ttft: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """`conveyor serve ...` on a free port, ready when /ready answers; SIGTERM on exit."""

    def __init__(self, argv: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "gateway", "serve", *argv, "--port", str(self.port),
               "--log-level", "error"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     start_new_session=True)

    def __enter__(self) -> Serve:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server not ready")

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int],
              max_tokens: int) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, usage = time.perf_counter(), 0.0, {}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            if not ttft and event["choices"] and event["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    return Result(ttft, usage["completion_tokens"], usage["prompt_tokens"],
                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def load(url: str, prompts: list[list[int]], max_tokens: int,
               concurrency: int) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)

    async def fire(p: list[int]) -> Result:
        async with sem:
            return await one(session, url, p, max_tokens)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as session:
        # warm-up: first-call costs stay out of the figures
        await one(session, url, prompts[0][:8], 2)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(fire(p) for p in prompts))
    return list(results), time.perf_counter() - t0


def row(label: str, results: list[Result], elapsed: float) -> str:
    ttfts = sorted(r.ttft for r in results)
    tokens = sum(r.tokens for r in results)
    hit = sum(r.cached_tokens for r in results) / max(1, sum(r.prompt_tokens for r in results))
    return (f"  {label:<42} {tokens / elapsed:8.1f} tok/s   TTFT p50 "
            f"{ttfts[len(ttfts) // 2] * 1e3:7.0f} ms  mean {sum(ttfts) / len(ttfts) * 1e3:7.0f} ms "
            f"  prefix hits {hit:5.1%}")


def compare(configs: list[tuple[str, list[str]]], rounds_prompts: list[list[list[int]]],
            max_tokens: int, concurrency: int) -> None:
    """Every config's server up at once (an idle one uses no CPU), then the workload on each in
    turn, for `rounds` rounds: load from other work on a shared machine falls on all configs alike,
    not on whichever ran during a busy minute. Prints each config's best round and its worst
    throughput."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(Serve(argv)) for _, argv in configs]
        runs: list[list[tuple[list[Result], float]]] = [[] for _ in configs]
        # new prompts each round: a repeated one would hit the prefix cache
        for prompts in rounds_prompts:
            for i, s in enumerate(servers):
                runs[i].append(asyncio.run(load(s.url, prompts, max_tokens, concurrency)))
    for (label, _), results in zip(configs, runs):
        rates = [sum(r.tokens for r in res) / elapsed for res, elapsed in results]
        best = max(range(len(results)), key=lambda k: rates[k])
        print(row(label, *results[best]) + f"   (worst round {min(rates):.1f} tok/s)", flush=True)


def tiny_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                      max_position_embeddings=2048, initializer_range=0.1)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    from tests.fakes import smollm2_tokenizer

    # ids beyond 8192 never occur: prompts are ids below it
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def all_reduce_bytes(model: str) -> str:
    """Bytes rank 0 puts into all-reduces per token and layer, over a prefill and some decode
    steps."""
    from engine.core import EngineCore
    from shared.config import build_config
    from shared.sampling import SamplingParams

    core = EngineCore(build_config(model, tensor_parallel_size=2, dtype="float32", num_threads=1,
                                   num_blocks=64))
    try:
        core.add("a", list(range(3, 67)),
                 SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        tokens = 0
        while core.has_work():
            before = core.num_steps
            core.step()
            step = core.last_step  # counts, in a dict of floats
            tokens += int(step["step_prefill_tokens"] + step["step_decode_tokens"])
            assert core.num_steps == before + 1
        comm = core.runner.rank0.comm  # type: ignore[attr-defined]
        layers, hidden = core.model_config.num_layers, core.model_config.hidden_size
        per = comm.bytes_all_reduced / tokens / layers
        return (f"  all-reduce bytes per token per layer (float32, hidden {hidden}): {per:.0f} "
                f"measured (2 all-reduces of hidden x 4 bytes = {2 * hidden * 4}, plus the "
                f"embedding's, spread over {layers} layers)")
    finally:
        core.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-tp3", action="store_true",
                   help="skip SmolLM2 at TP=3 (three ranks on two cores)")
    args = p.parse_args()
    print(f"scale-out benchmark on {machine()}; {cpu_features()}; dtype float32; a shared machine: "
          "other work may run beside it, so compare figures within this run only", flush=True)
    rng = random.Random(0)
    n, out_len = args.num_requests, 24
    prompts = [[[rng.randrange(100, 8000) for _ in range(48)] for _ in range(n)]
               for _ in range(args.rounds)]
    common = ["--dtype", "float32", "--kv-cache-memory", "256MiB"]
    smol = ["--model", "SmolLM2-135M-Instruct", *common]
    print(f"1. served workload: {n} requests, 48-token prompts, {out_len} tokens each, "
          f"{args.concurrency} in flight")
    print(f" SmolLM2-135M (best of {args.rounds} interleaved rounds):")
    smol_configs = [("DP=1, 2 threads (baseline)", [*smol, "--num-threads", "2"]),
                    ("DP=1, 1 thread (how 2 threads fare here)", [*smol, "--num-threads", "1"]),
                    ("DP=2, 1 thread each", [*smol, "--data-parallel-size", "2"])]
    if not args.skip_tp3:
        smol_configs.append(("TP=3, 1 thread per rank",
                             [*smol, "--tensor-parallel-size", "3", "--num-threads", "1"]))
    compare(smol_configs, prompts, out_len, args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(tiny_model(Path(tmp) / "tiny-llama"))
        print(" tiny random Llama (8 heads, 4 K/V heads, hidden 512, 4 layers; best of "
              f"{args.rounds} rounds):")
        compare([("TP=1, 2 threads (baseline)", ["--model", tiny, *common, "--num-threads", "2"]),
                 ("TP=1, 1 thread", ["--model", tiny, *common, "--num-threads", "1"]),
                 ("TP=2, 1 thread per rank", ["--model", tiny, *common, "--tensor-parallel-size",
                                              "2", "--num-threads", "1"])], prompts, out_len,
                args.concurrency)
        print("3. " + all_reduce_bytes(tiny).strip())
    systems = [[rng.randrange(100, 8000) for _ in range(256)] for _ in range(4)]
    # A random system prompt per request: in a fixed cycle of 4, round-robin over 2 replicas would
    # send each system prompt to one replica by accident.
    shared = [rng.choice(systems) + [rng.randrange(100, 8000) for _ in range(16)]
              for _ in range(32)]
    print("2. shared prefixes on DP=2: 4 system prompts of 256 tokens, 32 requests (+16 tokens "
          "each), 8 tokens out; one round (a second would find every prefix cached)")
    compare([("round-robin (baseline)",
              [*smol, "--data-parallel-size", "2", "--routing", "round_robin"]),
             ("prefix affinity", [*smol, "--data-parallel-size", "2"])], [shared], 8,
            args.concurrency)

if __name__ == "__main__":
    main()
