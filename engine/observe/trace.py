"""Step and request traces in Chrome's trace-event JSON (Perfetto and chrome://tracing open it).

Two processes in the trace:
  pid 1 "engine steps": one span per step ("step N"), and inside it one span per phase, in order:
        schedule, prepare (swaps, drafts, the varlen batch), forward, sample, output (the
        scheduler's update and the wire rows). A phase begins where `mark(name)` is called and ends
        at the next mark.
  pid 2 "requests": one track per request. Its span "request <id>" runs from queued to finished;
        inside it "queued" (until first scheduled), one "prefill" span per prompt chunk
        (recomputes too), one "decode" span per run of consecutive decode steps, "preempted" /
        "swapped" (until resumed), and a "finished" instant. Children are cut at step
        boundaries, so they nest in their request's span.

Bounded: events go to a ring (deque with maxlen), so a long run keeps its latest events and a trace
costs at most max_events * ~150 bytes. Recording costs a few microseconds a step while on and
nothing when off (the engine's mark is then a no-op function, and the per-step hooks are behind one
`is None` check).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from engine.step import StepPlan
    from shared.protocol import Error, RequestOutput

PHASES = ("schedule", "prepare", "forward", "sample", "output")
STEPS_PID, REQUESTS_PID = 1, 2
DEFAULT_MAX_EVENTS = 200_000
_CLEANUP_EVERY = 256  # steps between sweeps for requests that ended outside a step (aborts)


def no_mark(phase: str) -> None:
    """The engine's mark while nothing traces."""


@dataclass(slots=True)
class _Life:
    """What the tracer knows of one live request: its track, and the span it is in the middle of."""

    tid: int
    queued_us: float
    seen: bool = False  # scheduled at least once (the "queued" span is closed)
    decode_from: float = -1.0  # start of the open decode run, -1 when none
    decode_to: float = 0.0
    decode_step: int = -1  # the step that last extended it
    paused: str = ""  # "preempted" | "swapped" while out of the batch
    paused_from: float = 0.0


class Tracer:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._t0 = time.perf_counter()
        self._wall0 = time.time()  # to place the engine's wall-clock request events on this clock
        self._marks: list[tuple[str, float]] = []
        self._lives: dict[str, _Life] = {}
        self._names: dict[int, str] = {}  # tid -> request id, for the track names
        self._next_tid = 1
        # this step: (request id, tokens, is a prefill)
        self._scheduled: list[tuple[str, int, bool]] = []
        self._preempted: list[tuple[str, bool]] = []  # this step: (request id, swapped)

    def _us(self, t: float) -> float:
        return (t - self._t0) * 1e6

    # ------------------------------------------------------------ the step
    def mark(self, phase: str) -> None:
        """Phase `phase` of the current step begins now ("schedule" begins a step)."""
        if phase == "schedule":
            self._marks = []
        self._marks.append((phase, time.perf_counter()))

    def before_execute(self, plan: StepPlan) -> None:
        """What the plan does to each request, read before the step changes the sequences'
        counters."""
        self.mark("prepare")
        # A prefill computes prompt tokens (even one, after a prefix hit) or recomputes several
        # after a preemption.
        self._scheduled = [(s.request.request_id, n,
                            i not in plan.drafts and (s.num_computed_tokens < s.num_prompt_tokens
                                                      or n > 1))
                           for i, (s, n) in enumerate(zip(plan.seqs, plan.num_new_tokens))]
        self._preempted = [(s.request.request_id, s.swapped) for s in plan.preempted]
        for s in plan.seqs:
            if s.request.request_id not in self._lives:
                self._start(s.request.request_id, s.request.events.get("queued"))

    def end_step(self, step: int, plan: StepPlan, outputs: list[RequestOutput | Error],
                 live: Container[str]) -> None:
        """Close the step's span and its phases, and move each request it touched along its
        lifecycle. live: the ids of the engine's live requests (a request missing from it ended
        outside a step)."""
        end = time.perf_counter()
        marks = self._marks + [("", end)]
        start_us, end_us = self._us(marks[0][1]), self._us(end)
        self.events.append({"name": f"step {step}", "ph": "X", "pid": STEPS_PID, "tid": 1,
                            "ts": start_us, "dur": end_us - start_us,
                            "args": {"tokens": plan.num_tokens,
                                     "decode_tokens": plan.num_decode_tokens,
                                     "seqs": len(plan.seqs), "preempted": len(plan.preempted),
                                     "swap_out": len(plan.swap_out), "swap_in": len(plan.swap_in)}})
        for (name, t), (_, t_next) in zip(marks, marks[1:]):
            self.events.append({"name": name, "ph": "X", "pid": STEPS_PID, "tid": 1,
                                "ts": self._us(t), "dur": (t_next - t) * 1e6})
        self._lifecycles(step, start_us, end_us, outputs)
        if step % _CLEANUP_EVERY == 0:
            for rid in [r for r in self._lives if r not in live]:
                self._finish(rid, end_us, "abort")
            # names of tracks the ring no longer holds
            if len(self._names) > (self.events.maxlen or 0) // 4:
                keep = {e["tid"] for e in self.events if e["pid"] == REQUESTS_PID}
                keep |= {life.tid for life in self._lives.values()}
                self._names = {t: r for t, r in self._names.items() if t in keep}

    def _lifecycles(self, step: int, start_us: float, end_us: float,
                    outputs: list[RequestOutput | Error]) -> None:
        for rid, swapped in self._preempted:
            life = self._lives.get(rid)
            if life is not None:
                self._close_decode(life)
                life.paused, life.paused_from = ("swapped" if swapped else "preempted"), start_us
        prefills: dict[str, int] = {}
        for rid, n, is_prefill in self._scheduled:
            life = self._lives[rid]
            if life.paused:
                self._span(life, life.paused, life.paused_from, start_us)
                life.paused = ""
            if not life.seen:
                life.seen = True
                self._span(life, "queued", min(life.queued_us, start_us), start_us)
            if is_prefill:
                prefills[rid] = prefills.get(rid, 0) + n
            elif life.decode_step == step - 1 and life.decode_from >= 0:
                life.decode_to, life.decode_step = end_us, step
            elif life.decode_step != step:
                self._close_decode(life)
                life.decode_from, life.decode_to, life.decode_step = start_us, end_us, step
        for rid, n in prefills.items():
            life = self._lives[rid]
            self._close_decode(life)
            self._span(life, "prefill", start_us, end_us, {"tokens": n})
        for out in outputs:
            if out.request_id is not None and getattr(out, "finished", True):
                self._finish(out.request_id, end_us, getattr(out, "finish_reason", None) or "error")

    def _start(self, rid: str, queued_wall: float | None) -> None:
        tid = self._next_tid
        self._next_tid += 1
        if queued_wall is not None:
            queued = (queued_wall - self._wall0) * 1e6
        else:
            queued = self._us(time.perf_counter())
        self._lives[rid] = _Life(tid, queued)
        self._names[tid] = rid

    def _finish(self, rid: str, end_us: float, reason: str) -> None:
        life = self._lives.pop(rid, None)
        if life is None:
            return
        self._close_decode(life)
        if life.paused:
            self._span(life, life.paused, life.paused_from, end_us)
        self._span(life, f"request {rid}", life.queued_us, end_us, {"finish_reason": reason})
        self.events.append({"name": "finished", "ph": "i", "s": "t", "pid": REQUESTS_PID,
                            "tid": life.tid, "ts": end_us, "args": {"finish_reason": reason}})

    def _close_decode(self, life: _Life) -> None:
        if life.decode_from >= 0:
            self._span(life, "decode", life.decode_from, life.decode_to)
            life.decode_from, life.decode_step = -1.0, -1

    def _span(self, life: _Life, name: str, start_us: float, end_us: float,
              args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {"name": name, "ph": "X", "pid": REQUESTS_PID, "tid": life.tid,
                                 "ts": start_us, "dur": max(0.0, end_us - start_us)}
        if args:
            event["args"] = args
        self.events.append(event)

    # ------------------------------------------------------------ output
    def trace(self) -> dict[str, Any]:
        """The Chrome trace of what the ring holds: its events, with the names of their
        processes and tracks."""
        events = list(self.events)
        tids = {e["tid"] for e in events if e["pid"] == REQUESTS_PID}
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": STEPS_PID, "tid": 0,
             "args": {"name": "engine steps"}},
            {"name": "process_name", "ph": "M", "pid": REQUESTS_PID, "tid": 0,
             "args": {"name": "requests"}},
            {"name": "thread_name", "ph": "M", "pid": STEPS_PID, "tid": 1,
             "args": {"name": "step"}},
        ]
        meta += [{"name": "thread_name", "ph": "M", "pid": REQUESTS_PID, "tid": tid,
                  "args": {"name": self._names.get(tid, f"request {tid}")}} for tid in sorted(tids)]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"producer": "conveyor", "dropped": self.events.maxlen is not None
                              and len(self.events) == self.events.maxlen}}

    def write(self, path: str | Path) -> None:
        """Flush the ring to path (a whole file, replaced)."""
        Path(path).write_bytes(orjson.dumps(self.trace()))
