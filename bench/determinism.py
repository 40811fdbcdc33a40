"""What invariance costs, and whether one request's text depends on the traffic
(docs/determinism.md).

    python bench/determinism.py [--num-requests 64] [--repeats 20] [--modes default,deterministic]

Serves the default model (the default configuration) twice in turn, without and with
--deterministic, and measures on each, side by side in one run: output tok/s at 32 concurrent
streams, single-stream inter-token latency, and the number of distinct texts of one greedy request
sent --repeats times, each time beside a random background load of 0..31 other streams (one text =
independent of the traffic). Prints the CPU's flags and what each side ran. Progress to stderr,
figures to stdout. --modes runs one side only, so that a quiet run (every other process stopped) can
be cut into pieces of a few minutes; the cost ratio is printed only when both sides ran in the same
run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp

from bench.english import chat_prompts
from bench.serving import run_load
from bench.vs_vllm import NAME, bodies, log_file, measure, ran_as, running, say

MODES = {"default": (), "deterministic": ("--deterministic",)}


async def one_text(url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        data = await r.json()
        return str(data["choices"][0]["text"])


async def texts_under_load(url: str, prompt: list[int], background: list[dict[str, Any]],
                           repeats: int, seed: int) -> list[str]:
    """The target request `repeats` times, each sent at a random moment into a fresh background
    load."""
    rng, out = random.Random(seed), []
    for _ in range(repeats):
        load = rng.sample(background, rng.randint(0, 31))
        task = asyncio.create_task(run_load(url, load, None, 32)) if load else None
        # the target joins a step in flight at a random point
        await asyncio.sleep(rng.uniform(0, 0.3))
        out.append(await one_text(url, prompt, 64))
        if task is not None:
            await task
    return out


def bench_mode(mode: str, port: int, served: list[dict[str, Any]], single: list[dict[str, Any]],
               target: list[int], background: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    import uvloop

    with running("conveyor", "auto", port, Path(sys.executable), extra=MODES[mode]):
        url = f"http://127.0.0.1:{port}"
        measure(port, served[:8], 8)  # warm the shapes
        many = measure(port, served, 32)
        one = measure(port, single, 1)
        texts = uvloop.run(texts_under_load(url, target, background, repeats, seed=7))
    ran = ran_as("conveyor", "auto", log_file("conveyor", "auto", MODES[mode]))
    return {"ran": ran, "tok_s": many["tok_s"], "itl50": one["itl50"],
            "distinct": len(set(texts))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--modes", type=lambda v: v.split(","), default=list(MODES),
                    help="which sides, in this order: default, deterministic")
    args = ap.parse_args()
    if not args.modes or set(args.modes) - set(MODES):
        ap.error(f"--modes: a comma-separated subset of {', '.join(MODES)}")
    from bench.common import cpu_features, machine
    from shared.config import DEFAULT_MODEL
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(DEFAULT_MODEL))
    served = bodies(chat_prompts(tok, args.num_requests, (32, 512), (8, 256), 0))
    single = bodies(chat_prompts(tok, 4, (128, 128), (128, 128), 2))
    background = bodies(chat_prompts(tok, 64, (32, 512), (16, 128), 4))
    target = chat_prompts(tok, 1, (200, 200), (64, 64), 6)[0][0]
    rows = {}
    for mode in args.modes:
        say(f"{mode}: served, single stream, {args.repeats} repeats under load")
        rows[mode] = bench_mode(mode, args.port, served, single, target, background, args.repeats)
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"machine: {machine()}; {cpu_features()}")
    print(f"model: {DEFAULT_MODEL} (the default configuration; --deterministic beside it)")
    print("\n| mode | ran as | output tok/s, 32 streams | single-stream ITL p50 ms | distinct "
          "texts / repeats |")
    print("|---|---|---:|---:|---:|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['ran']} | {r['tok_s']:.1f} | {r['itl50'] * 1e3:.1f} | "
              f"{r['distinct']} / {args.repeats} |")
    if set(rows) != set(MODES):
        return
    base, det = rows["default"], rows["deterministic"]
    print(f"\n--deterministic / default: throughput {det['tok_s'] / base['tok_s']:.2f}x, "
          f"single-stream ITL {det['itl50'] / base['itl50']:.2f}x")


if __name__ == "__main__":
    main()
