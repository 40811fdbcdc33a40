"""What an engine's trace (engine/observe/trace.py) says each step computed, for tests that assert
how work was batched or chunked through the engine's public record rather than its internals."""
from __future__ import annotations

from engine.observe.trace import REQUESTS_PID, STEPS_PID, Tracer


def step_sizes(tracer: Tracer) -> list[int]:
    """Sequences computed in each traced step, in step order."""
    return [e["args"]["seqs"] for e in tracer.events if e["pid"] == STEPS_PID
            and e["name"].startswith("step ")]


def prefill_chunks(tracer: Tracer) -> dict[str, list[int]]:
    """Request id -> the prompt tokens it computed in each step that prefilled it, in step order."""
    events = tracer.trace()["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["pid"] == REQUESTS_PID
             and e["name"] == "thread_name"}
    chunks: dict[str, list[int]] = {}
    for e in events:
        if e["pid"] == REQUESTS_PID and e["name"] == "prefill":
            chunks.setdefault(names[e["tid"]], []).append(e["args"]["tokens"])
    return chunks
