"""Soak: thousands of mixed requests against a real `conveyor serve` whose engine is SIGKILLed
twice.

    python bench/soak.py [--requests 10000] [--clients 32] [--model PATH_OR_NAME] [--seed 0]
                         [--topology single|tp|dp] [--freeze SECONDS]

It starts `conveyor serve` as a user would (a subprocess in its own session, torn down at the end)
on a tiny random Llama with SmolLM2's tokenizer (or --model), a KV pool small enough that preemption
(swap and recompute) is constant, and `--speculative ngram`. A bounded pool of aiohttp clients then
sends --requests requests to 127.0.0.1: greedy, seeded, unseeded, n > 1, beam search, penalties,
logprobs, chat, long prompts, streamed (SSE or WebSocket) or not, some opting out of speculation.
One request in 50 is malformed (bad JSON, out-of-range or unknown fields, token ids past the
vocabulary); 20% of the others go away at a random moment. At a third and two thirds of the run the
engine is SIGKILLed: the gateway restarts it and resumes the streams in flight. `--topology tp`
serves with `-tp 2` (speculating as the default does: greedy requests) and kills its worker rank,
which takes the engine down and back up whole; `--topology dp` serves with `-dp 2` and kills each
replica in turn, whose streams move to the other at once; `--freeze S` SIGSTOPs the same target for
S seconds instead of killing it.

Every request ends in exactly one class, and the run fails (exit 1) unless lost, leaked and stalled
are 0:
  completed   a final answer: [DONE] after the last chunk, or a whole JSON response
  aborted     the client went away first (by design)
  refused     a malformed request answered 400 (as it must be)
  unresumable in flight at a kill with n > 1, beam search or penalties: an error naming
              "cannot be resumed" (docs/reliability.md says why these are not resumed)
  errors      anything else: a 5xx, an unexpected error event, a 400 for a good request, a 200 for a
              malformed one, usage that does not count each token exactly once
  lost        no final answer: a stream cut without [DONE] or error, a dropped connection, or
              nothing within --deadline seconds (a hang)
New requests during a restart get 503 with Retry-After; clients retry them (counted), as a good
client would. Leaked blocks and queues come from the engine's STATS once the run is over; stalled
steps from /metrics, summed over the three engine lives (each engine counts from zero).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp
import orjson

VOCAB = 49152  # SmolLM2's tokenizer, and so the tiny model's vocabulary
GREEDY_PROMPTS = ["The soak test", "Once upon a time", "def main():", "1, 2, 3, 4,", "Paris is the"]
# the gateway's log line when it resubmits requests to a new engine
RESUMING = r"resuming (\d+) request"
# ... and when it moves them to a live replica
MOVED = r"lost: (\d+) request\(s\) resumed on the live replicas"
WORDS = ("the a river stone light engine queue token block cache stream model step batch "
         "word").split()
# each must be answered 400; the three crashes first
MALFORMED: list[dict[str, Any] | bytes] = [
    {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [100000]},
    {"prompt": "hi", "use_beam_search": True, "length_penalty": 1000, "max_tokens": 16},
    {"prompt": "hi", "use_beam_search": True, "length_penalty": -1000, "max_tokens": 16},
    b'{"prompt": "hi", "max_tokens": ', b"\xff\xfe not json", {"prompt": [1, 2, VOCAB + 7]},
    {"prompt": "hi", "logit_bias": {str(VOCAB): 5}}, {"prompt": "hi", "frobnicate": 1},
    {"prompt": "hi", "ignore_eos": "false"}, {"prompt": "hi", "temperature": 1000},
    {"prompt": "hi", "n": 0},
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "response_format": {"type": "json_object"}},
    {"prompt": "hi", "top_p": 0}, {"prompt": "hi", "logprobs": 50},
]


@dataclass
class Job:
    index: int
    body: dict[str, Any] | bytes
    chat: bool = False
    ws: bool = False
    # seconds before the client goes away; None: it waits for the answer
    patience: float | None = None
    expect_tokens: int | None = None  # completion tokens the usage must count
    resumable: bool = True
    greedy_key: str | None = None  # same prompt and length, greedy: the same text every time


@dataclass
class Outcome:
    kind: str  # completed, aborted, refused, unresumable, error, lost
    detail: str = ""
    start: float = 0.0
    end: float = 0.0
    text: str = ""
    retries: int = 0
    greedy_key: str | None = None


@dataclass
class Run:
    """What the run's tasks share: each field has one writer (the clients, the killer or the
    monitor)."""
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: int = 0
    kills: list[float] = field(default_factory=list)
    # engine pids (one engine, or both replicas: "a,b") -> its counter's last value; under dp a
    # replica that outlives a kill is counted in both sets, so a stalled count there is an upper
    # bound
    stalled: dict[str, float] = field(default_factory=dict)
    preempted: dict[str, float] = field(default_factory=dict)
    pids: list[str] = field(default_factory=list)


def shape_fields(shape: str, rng: random.Random) -> dict[str, Any]:
    """The sampling fields of a request shape; n, beam and penalty ones cannot be resumed (by
    design)."""
    seed = rng.randrange(2**31)
    table: dict[str, dict[str, Any]] = {
            "greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": seed},
            # rare: a top-k row sorts the whole batch's logits
            "sampled": {"temperature": 1.0, "top_k": 50},
            "n": {"n": rng.randint(2, 3), "temperature": 0.7, "seed": seed},
            "beam": {"use_beam_search": True, "beam_width": rng.randint(2, 4), "temperature": 0},
            "penalty": {"presence_penalty": 0.5, "temperature": 0.9},
            "logprobs": {"logprobs": 2, "temperature": 0, "repetition_penalty": 1.1}}
    return table[shape]


def make_job(i: int, rng: random.Random) -> Job:
    """The i-th request: a seeded draw of shape, prompt, length, door and patience."""
    if i % 50 == 49:
        bad = MALFORMED[(i // 50) % len(MALFORMED)]
        if isinstance(bad, dict) and rng.random() < 0.5:
            bad = {**bad, "stream": True}
        return Job(i, bad)
    shape = rng.choices(["greedy", "seeded", "sampled", "n", "beam", "penalty", "logprobs"],
                        [38, 20, 2, 8, 7, 5, 20])[0]
    body: dict[str, Any] = {"max_tokens": rng.randint(4, 16), "ignore_eos": True,
                            **shape_fields(shape, rng)}
    job = Job(i, body, resumable=shape not in ("n", "beam", "penalty"))
    # a prompt greedy requests repeat: the same text each time
    fixed = shape == "greedy" and rng.random() < 0.5
    prompt: str | list[int]
    if fixed:
        prompt = rng.choice(GREEDY_PROMPTS)
        body["max_tokens"] = 24
    # long, repetitive enough for ngram drafts to hit; a beam
    elif rng.random() < 0.1 and shape != "beam":
        # group's worst case must fit the small pool (the engine refuses it with a 400 otherwise)
        motif = [rng.randrange(100, VOCAB) for _ in range(rng.randint(5, 40))]
        prompt = (motif * 40)[:rng.randint(300, 700)]
    else:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))
    job.expect_tokens = None if shape == "beam" else body.get("n", 1) * body["max_tokens"]
    job.chat = isinstance(prompt, str) and rng.random() < 0.3
    if job.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if "logprobs" in body:
            body.update(logprobs=True, top_logprobs=body["logprobs"])
    else:
        body["prompt"] = prompt
    if fixed:
        job.greedy_key = f"{'chat' if job.chat else 'text'}: {prompt}"
    if rng.random() < 0.3:
        body["speculative"] = False
    if rng.random() < 0.6:
        body.update(stream=True, stream_options={"include_usage": True})
        job.ws = rng.random() < 0.25
    if rng.random() < 0.2:
        job.patience = rng.choice([0.0, 0.01, 0.05]) + rng.expovariate(1 / 0.5)
    return job


# -- one client request ----------------------------------------------------------------------------


class Answer:
    """One request's chunks as they arrive (text per choice, usage) and how it ended."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False
        self.status = 0
        self.retry_after = 1.0

    def chunk(self, obj: dict[str, Any]) -> None:
        if "error" in obj:
            self.error = str(obj["error"].get("message", obj["error"]))
            return
        self.usage = obj.get("usage") or self.usage
        for c in obj.get("choices", []):
            piece = (c["delta"].get("content") or "") if "delta" in c else c.get("text") or ""
            if "message" in c:
                piece = c["message"].get("content") or ""
            self.texts.setdefault(c.get("index", 0), []).append(piece)


async def post(session: aiohttp.ClientSession, url: str, job: Job, ans: Answer) -> int:
    """One attempt over HTTP -> its status (ans says how it ended)."""
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    data = job.body if isinstance(job.body, bytes) else orjson.dumps(job.body)
    async with session.post(url + path, data=data,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            ans.retry_after = min(float(resp.headers.get("Retry-After", "1")), 5.0)
            body = await resp.read()
            try:
                ans.error = str(orjson.loads(body)["error"]["message"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                ans.error = body[:200].decode(errors="replace")
            return resp.status
        if isinstance(job.body, dict) and job.body.get("stream"):
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    ans.done = True
                elif line.startswith(b"data: "):
                    ans.chunk(orjson.loads(line[6:]))
        else:
            ans.chunk(orjson.loads(await resp.read()))
            ans.done = ans.error is None
        return 200


async def websocket(session: aiohttp.ClientSession, url: str, job: Job, ans: Answer) -> int:
    """One attempt over the WebSocket door: chunk frames, then done or error."""
    assert isinstance(job.body, dict)
    async with session.ws_connect(url + "/v1/ws") as sock:
        await sock.send_str(orjson.dumps({"op": "chat.completions" if job.chat else "completions",
                                          "id": "r", "body": job.body}).decode())
        async for msg in sock:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            frame = orjson.loads(msg.data)
            if frame["event"] == "chunk":
                ans.chunk(frame["data"])
            elif frame["event"] == "error":
                ans.error = str(frame["error"].get("message"))
                return int(frame.get("status", 500))
            else:
                ans.done = frame["event"] == "done"
                return 200
    return 200


async def attempt_until_answered(session: aiohttp.ClientSession, url: str, job: Job,
                                 out: Outcome) -> Answer:
    """Retries 503/429 refusals (the engine restarting, the queue full) after Retry-After, as a
    client should; a request that cannot be resumed is not refused but ended, so it is not
    retried."""
    for _ in range(120):
        ans = Answer()
        ans.status = await (websocket if job.ws else post)(session, url, job, ans)
        if ans.status not in (429, 503) or "cannot be resumed" in (ans.error or ""):
            return ans
        out.retries += 1
        await asyncio.sleep(ans.retry_after)
    return ans


def classify(job: Job, ans: Answer, out: Outcome) -> None:
    status = ans.status
    if isinstance(job.body, bytes) or job.index % 50 == 49:
        out.kind, out.detail = ("refused", "") if status == 400 else ("error",
                                                                      f"malformed got {status}: "
                                                                      f"{job.body!r}")
    elif ans.error is not None:
        expected = "cannot be resumed" in ans.error and not job.resumable
        out.kind, out.detail = ("unresumable", "") if expected else ("error",
                                                                     f"{status}: {ans.error[:200]}")
    elif not ans.done:
        out.kind, out.detail = "lost", "the stream ended without [DONE] or an error"
    else:
        got = (ans.usage or {}).get("completion_tokens")
        wants_usage = not job.ws or bool(ans.usage)
        if job.expect_tokens is not None and wants_usage and got != job.expect_tokens:
            out.kind, out.detail = ("error", f"usage counts {got} completion tokens, expected "
                                             f"{job.expect_tokens}")
        else:
            out.kind, out.text = "completed", "".join(ans.texts.get(0, []))


async def one(session: aiohttp.ClientSession, url: str, job: Job, deadline: float,
              run: Run) -> Outcome:
    out = Outcome("lost", start=time.monotonic(), greedy_key=job.greedy_key)
    run.in_flight += 1
    try:
        ans = await asyncio.wait_for(attempt_until_answered(session, url, job, out),
                                     job.patience or deadline)
        classify(job, ans, out)
    except TimeoutError:
        out.kind, out.detail = (("aborted", "") if job.patience is not None
                                else ("lost", f"no answer in {deadline}s"))
    except (aiohttp.ClientError, orjson.JSONDecodeError) as e:  # cut off, or a garbled answer: none
        out.kind, out.detail = "lost", f"{type(e).__name__}: {e}"
    # an answer of a shape this client did not expect: counted, shown, not fatal
    except Exception as e:
        out.kind, out.detail = "error", f"{type(e).__name__}: {e}"
    finally:
        run.in_flight -= 1
    out.end = time.monotonic()
    return out


# -- the server, the killer, the monitor -----------------------------------------------------------


def build_tiny_model(folder: Path) -> Path:
    """tests/e2e/conftest.py's TINY_CHAT: a 2-layer random Llama under SmolLM2's real tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True, initializer_range=0.15)
    LlamaForCausalLM(config).save_pretrained(folder)
    source = resolve_model("SmolLM2-135M-Instruct")
    cache_dir = Path(os.environ["CONVEYOR_CACHE"]) / source.cache_dir.name
    load_tokenizer(source, cache_dir=cache_dir).save_pretrained(folder)
    return folder


TOPOLOGIES = ("single", "tp", "dp")  # what --topology starts, and so what its kills hit
TOPOLOGY_FLAGS = {"single": ["--speculative", "ngram"],
                  "tp": ["-tp", "2", "--collective-timeout", "120"], "dp": ["-dp", "2"]}


def engines(gateway: int) -> list[int]:
    from tests.e2e.servers import children, cmdline

    return [p for p in children(gateway) if cmdline(p)[1:3] == ["-m", "engine"]]


def engine_pid(gateway: int) -> str | None:
    """The engines' pids as one key (a new one after each restart); None while some are missing."""
    pids = engines(gateway)
    return ",".join(map(str, pids)) if len(pids) == ENGINES[0] else None


ENGINES = [1]  # engines `serve` runs (2 under dp); set once from --topology


def victim(gateway: int, topology: str, k: int) -> int | None:
    """What the k-th kill hits: the engine (single); one tensor-parallel worker of it (tp: the
    engine then exits and is restarted whole); replica k % 2 (dp: its streams move to the other
    replica)."""
    from tests.e2e.servers import children, cmdline

    pids = engines(gateway)
    if len(pids) != ENGINES[0]:
        return None
    if topology == "tp":
        workers = [p for p in children(pids[0])
                   if "engine.distributed.worker" in " ".join(cmdline(p))]
        return workers[0] if workers else None
    return pids[k % len(pids)]


async def scrape(session: aiohttp.ClientSession, url: str, gateway: int, run: Run) -> None:
    """The engine's stalled-step and preemption counters from /metrics, kept per engine life.
    Counted only when the engine answered and the same engine process was there before and after the
    scrape."""
    from gateway.metrics import parse

    before = engine_pid(gateway)
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            metrics = parse(await resp.text())
    except (aiohttp.ClientError, TimeoutError):
        return
    if (before is not None and before == engine_pid(gateway)
            and metrics.get("conveyor_engine_up") == 1):
        run.stalled[before] = metrics["conveyor_engine_stalled_steps_total"]
        run.preempted[before] = metrics.get("conveyor_num_preemptions_total", 0.0)
        if before not in run.pids:
            run.pids.append(before)


async def monitor(url: str, gateway: int, run: Run, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            await scrape(session, url, gateway, run)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


async def killer(url: str, gateway: int, total: int, kills: int, run: Run, topology: str,
                 freeze: float) -> None:
    """SIGKILLs an engine (or a rank of one) at even fractions of the run, each time with at least 8
    requests in flight; with freeze > 0, SIGSTOPs it for that many seconds instead, then SIGCONT."""
    async with aiohttp.ClientSession() as session:
        for k in range(1, kills + 1):
            for _ in range(36000):  # an hour at most; the end of the run cancels this task sooner
                if len(run.outcomes) >= total * k // (kills + 1) and run.in_flight >= 8:
                    break
                await asyncio.sleep(0.1)
            pid = victim(gateway, topology, k)
            if pid is None:
                continue
            await scrape(session, url, gateway, run)  # the dying engine's last counters
            run.kills.append(time.monotonic())
            what = f"SIGSTOP for {freeze:g} s" if freeze else "SIGKILL"
            print(f"  {what} {topology} pid {pid} after {len(run.outcomes)} answers, "
                  f"{run.in_flight} in flight", flush=True)
            if not freeze:
                os.kill(pid, signal.SIGKILL)
                continue
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(freeze)
            os.kill(pid, signal.SIGCONT)


async def drive(args: argparse.Namespace, url: str, gateway: int) -> Run:
    rng = random.Random(args.seed)
    jobs = [make_job(i, rng) for i in range(args.requests)]
    run, stop = Run(), asyncio.Event()
    watch = asyncio.create_task(monitor(url, gateway, run, stop))
    kill = asyncio.create_task(killer(url, gateway, len(jobs), args.kills, run, args.topology,
                                      args.freeze))
    todo = iter(jobs)
    # One connection per request: a client that goes away really closes its socket, as a browser tab
    # does.
    connector = aiohttp.TCPConnector(force_close=True, limit=args.clients)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def client() -> None:
            for job in todo:
                run.outcomes.append(await one(session, url, job, args.deadline, run))
                if len(run.outcomes) % 1000 == 0:
                    kinds = Counter(o.kind for o in run.outcomes)
                    print(f"  {len(run.outcomes)} answered, {kinds}", flush=True)

        await asyncio.gather(*(client() for _ in range(args.clients)))
    kill.cancel()
    stop.set()
    await asyncio.gather(watch, kill, return_exceptions=True)
    async with aiohttp.ClientSession() as session:
        await scrape(session, url, gateway, run)
    return run


async def final_stats(addresses: list[str]) -> dict[str, float]:
    """The engines' STATS, summed, once each holds nothing (or after 60 s, whatever it holds)."""
    from shared.client import AsyncEngineClient
    from tests.e2e.servers import is_idle

    total: dict[str, float] = {}
    for address in addresses:
        async with AsyncEngineClient(address, name="soak", ready_timeout=30) as client:
            for _ in range(600):
                stats = await client.get_stats()
                if is_idle(stats):
                    break
                await asyncio.sleep(0.1)
        for k, v in stats.items():
            total[k] = total.get(k, 0.0) + v
    return total


# -- the report ------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return ", ".join(f"{name}: {'yes' if name in flags else 'no'}"
                     for name in ("avx512_bf16", "amx_bf16"))


def report(run: Run, stats: dict[str, float], log: str, wall: float, gateway_alive: bool) -> int:
    """Prints the figures; -> the exit code: 1 when anything was lost, leaked or stalled."""
    from bench.common import machine

    done = [o for o in run.outcomes if o.kind == "completed"]
    kinds, lat = Counter(o.kind for o in run.outcomes), [o.end - o.start for o in done]
    greedy: dict[str, set[str]] = {}
    for o in done:
        if o.greedy_key is not None:
            greedy.setdefault(o.greedy_key, set()).add(o.text)
    leaked = int(stats["num_blocks"] - stats["num_free_blocks"]
                 + stats.get("num_cpu_blocks", 0) - stats.get("num_free_cpu_blocks", 0))
    queued = {k: int(stats.get(k, 0)) for k in ("num_running", "num_waiting", "num_swapped")}
    stalled = int(sum(run.stalled.values()))
    resubmitted = sum(int(n) for n in re.findall(RESUMING, log))
    print(f"\nmachine: {machine()}; {cpu_flags()}")
    print(f"{len(run.outcomes)} requests in {wall:.0f} s: completed {kinds['completed']}, aborted "
          f"{kinds['aborted']}, refused {kinds['refused']}, unresumable {kinds['unresumable']}, "
          f"errors {kinds['error']}, lost {kinds['lost']}; {sum(o.retries for o in run.outcomes)} "
          "retries after a 503/429")
    moved = sum(int(n) for n in re.findall(MOVED, log))
    print(f"engine restarts: {log.count('engine_restart exit=')} (log; {len(run.kills)} SIGKILLs, "
          f"{len(run.pids)} engine sets seen); resumed streams: {resubmitted} resubmitted to a "
          f"restarted engine, {moved} moved to a live replica (log), "
          f"{sum(1 for o in done if any(o.start < k < o.end for k in run.kills))} in flight at a "
          "kill and completed")
    print(f"preemptions: {int(sum(run.preempted.values()))}; stalled steps: {stalled}; leaked "
          f"blocks at the end: {leaked}; {queued}; gateway alive: {gateway_alive}")
    print(f"latency of completed requests: p50 {pct(lat, 50):.3f} s, p99 {pct(lat, 99):.3f} s")
    print(f"greedy: {sum(1 for o in done if o.greedy_key)} completions of {len(greedy)} fixed "
          "prompts; prompts with differing texts: "
          f"{sorted(k for k, t in greedy.items() if len(t) > 1) or 'none'}")
    for (kind, detail), count in Counter((o.kind, o.detail) for o in run.outcomes
                                         if o.kind in ("error", "lost")).most_common(10):
        print(f"  {count} x {kind}: {detail}")
    if log.count("Traceback"):
        print(f"the gateway's log has {log.count('Traceback')} traceback(s)")
    bad = kinds["lost"] or leaked or stalled or any(queued.values()) or not gateway_alive
    print("FAIL" if bad else "OK: nothing lost, nothing leaked, nothing stalled")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--clients", type=int, default=32, help="requests in flight at most")
    p.add_argument("--kills", type=int, default=2,
                   help="engine SIGKILLs, spread evenly over the run")
    p.add_argument("--model", default=None,
                   help="a HF folder or model name (e.g. SmolLM2-135M-Instruct); default: a tiny "
                        "random Llama under SmolLM2's tokenizer, built in a temp folder")
    p.add_argument("--num-kv-blocks", type=int, default=96,
                   help="16-token blocks: small, so preemption is constant")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds a request may take before it is lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topology", choices=TOPOLOGIES, default="single",
                   help="single: one engine (--speculative ngram), kills hit it; tp: -tp 2, kills "
                        "hit its worker rank; dp: -dp 2, kills hit each replica in turn")
    p.add_argument("--freeze", type=float, default=0.0, metavar="SECONDS",
                   help="instead of each SIGKILL, SIGSTOP the same process for this long, then "
                        "SIGCONT")
    args = p.parse_args()
    ENGINES[0] = 2 if args.topology == "dp" else 1
    from tests.e2e.servers import ROOT, Server

    with tempfile.TemporaryDirectory(prefix="conveyor-soak-") as tmp:
        os.environ.setdefault("CONVEYOR_CACHE", str(Path(tmp) / "cache"))
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny-chat"))
        argv = ["serve", "--model", model, "--num-threads", "1", "--num-kv-blocks",
                str(args.num_kv_blocks), "--block-size", "16", "--swap-space", "256KiB",
                "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
                *TOPOLOGY_FLAGS[args.topology], "--log-level", "warning"]
        print(f"conveyor {' '.join(argv)}", flush=True)
        log = Path(tmp) / "server.log"
        env = {"PYTHONPATH": str(ROOT), "CONVEYOR_CACHE": os.environ["CONVEYOR_CACHE"]}
        with Server(argv, env=env, log_path=log, ready_timeout=600) as srv:
            t0 = time.monotonic()
            run = asyncio.run(drive(args, srv.url, srv.pid))
            wall = time.monotonic() - t0
            addresses = ([f"ipc:///tmp/conveyor-{srv.pid}-{i}.sock" for i in range(2)]
                         if args.topology == "dp" else [f"ipc:///tmp/conveyor-{srv.pid}.sock"])
            stats = asyncio.run(final_stats(addresses))
            alive = srv.proc is not None and srv.proc.poll() is None
        return report(run, stats, log.read_text(errors="replace"), wall, alive)


if __name__ == "__main__":
    sys.exit(main())
