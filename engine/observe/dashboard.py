"""What the dashboard sees of the engine: a compact row per step, and snapshots of the queues and
the KV block map, sent to the clients that asked (OBSERVE) until their subscription expires.

Nothing is computed while nobody watches: the loop calls on_step only while `watchers` is non-empty,
and a subscription lapses unless renewed (the gateway renews it while a dashboard viewer is
connected), so a gateway that vanished costs nothing after at most MAX_SUBSCRIPTION seconds. While
watched, a step costs one short tuple and a few dictionary updates (per output row, for the latency
samples); a snapshot (a walk over the queues and the block pool) is built at most SNAPSHOT_INTERVAL
apart, and everything goes out batched, at most one message per FLUSH_INTERVAL per watcher, each
bounded (MAX_* below).

Snapshot layout (a JSON object; the gateway forwards it as is, gateway/static/dashboard.js reads
it):
  step, t (wall clock), num_blocks, num_cpu_blocks, block_size, stats (EngineCore.stats())
  seqs: one row per sequence, [label, queue, prompt computed, prompt length, generated, max tokens,
        priority, preemptions, cached prompt tokens, holder]; queue is "running" | "swapped" |
        "waiting" (at most MAX_ROWS rows per queue; counts has the full lengths)
  counts: {"running", "swapped", "waiting"}: queue lengths, as /metrics counts them (sequences)
  blocks: per device block, its holder: -2 free and empty, -1 free and holding a cached prefix,
          >= 0 an index into holders (the request holding it)
  shared: [[device block, ref count], ...] for every block with ref count > 1
  cpu_blocks: per CPU block, the same code (the swap pool and the prefix cache's CPU tier)
  holders: request ids, by holder index
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from shared.protocol import Error, Observed, RequestOutput

if TYPE_CHECKING:
    from engine.core import EngineCore
    from engine.sequence import Sequence

MAX_SUBSCRIPTION = 10.0  # seconds a subscription may ask for; the gateway renews every second
FLUSH_INTERVAL = 0.1  # seconds between two messages to a watcher
SNAPSHOT_INTERVAL = 0.2  # seconds between two snapshots
# per message; older rows of a burst are dropped (the rows carry their step number)
MAX_STEP_ROWS = 512
MAX_ROWS = 256  # sequence rows per queue in a snapshot
MAX_SAMPLES = 512  # latency samples per message (TTFT and ITL each)
FREE_EMPTY, FREE_CACHED = -2, -1


class Observer:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        # client identity -> monotonic time its subscription ends
        self.watchers: dict[bytes, float] = {}
        self._rows: deque[tuple[float, ...]] = deque(maxlen=MAX_STEP_ROWS)
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._last_token: dict[str, float] = {}  # request id -> when its last tokens came (for ITL)
        self._next_flush = 0.0
        self._next_snapshot = 0.0
        self._last_row = 0  # the step of the last row recorded

    def subscribe(self, client: bytes, seconds: float) -> None:
        """client watches for the next `seconds` (0 ends its subscription)."""
        if seconds <= 0:
            self.drop(client)
            return
        if not self.watchers:  # the first watcher starts on a fresh snapshot
            self._next_snapshot = self._next_flush = 0.0
        self.watchers[client] = time.monotonic() + min(seconds, MAX_SUBSCRIPTION)

    def drop(self, client: bytes) -> None:
        self.watchers.pop(client, None)
        if not self.watchers:
            self._rows.clear()
            self._ttft, self._itl = [], []
            self._last_token.clear()

    def on_step(self, outputs: Seq[RequestOutput | Error]) -> None:
        """After a step, while watched: its row, and latency samples from its outputs."""
        now = time.time()
        sampled = 0
        last, itl = self._last_token, self._itl
        for out in outputs:
            if isinstance(out, Error):
                last.pop(out.request_id or "", None)
                continue
            n = len(out.new_token_ids)
            sampled += n
            if n:
                prev = last.get(out.request_id)
                if prev is not None and len(itl) < 4 * MAX_SAMPLES:
                    itl.append((now - prev) / n)
                last[out.request_id] = now
            if out.finished:
                last.pop(out.request_id, None)
                ev = out.events or {}
                if "first_token" in ev and "queued" in ev and len(self._ttft) < MAX_SAMPLES:
                    self._ttft.append(ev["first_token"] - ev["queued"])
        # no plan this time (nothing could run): no new step
        if self.core.num_steps == self._last_row:
            return
        self._last_row = self.core.num_steps
        s = self.core.last_step
        self._rows.append((self.core.num_steps, now, s["step_prefill_tokens"],
                           s["step_decode_tokens"], s["step_num_seqs"], s["step_seconds"],
                           s["step_preempted"], s["step_swapped_out_blocks"],
                           s["step_swapped_in_blocks"], sampled))

    def due(self, force: bool = False) -> list[tuple[bytes, Observed]]:
        """The messages to send now (none until FLUSH_INTERVAL has passed, unless forced); expired
        watchers are dropped."""
        mono = time.monotonic()
        if mono < self._next_flush and not force:
            return []
        for client in [c for c, until in self.watchers.items() if until <= mono]:
            self.drop(client)
        if not self.watchers:
            return []
        self._next_flush = mono + FLUSH_INTERVAL
        snapshot = None
        if mono >= self._next_snapshot:
            self._next_snapshot = mono + SNAPSHOT_INTERVAL
            snapshot = self.snapshot()
        itl = self._itl[:: max(1, len(self._itl) // MAX_SAMPLES)][:MAX_SAMPLES]
        msg = Observed([list(r) for r in self._rows], snapshot, self._ttft, itl)
        self._rows.clear()
        self._ttft, self._itl = [], []
        return [(client, msg) for client in self.watchers]

    def snapshot(self) -> dict[str, Any]:
        """The queues and both block pools as they stand between two steps."""
        core = self.core
        sched, bm = core.scheduler, core.block_manager
        holders: dict[str, int] = {}
        dev, cpu = bm.device, bm.cpu
        blocks = [FREE_EMPTY if dev.block_hash[b] is None else FREE_CACHED
                  for b in range(dev.num_blocks)]
        cpu_blocks = [FREE_EMPTY if cpu.block_hash[b] is None else FREE_CACHED
                      for b in range(cpu.num_blocks)]
        seqs: list[list[Any]] = []
        for queue, name in ((sched.running, "running"), (sched.swapped, "swapped"),
                            (sched.waiting, "waiting")):
            for i, seq in enumerate(queue):
                rid = seq.request.request_id
                holder = holders.setdefault(rid, len(holders))
                table = cpu_blocks if seq.swapped else blocks
                # not the placeholder of released ones
                for b in seq.block_table[seq.released_blocks:]:
                    table[b] = holder
                if i < MAX_ROWS:
                    seqs.append(_row(seq, name, holder))
        # Held blocks no queued sequence names (a held CPU copy between two steps): shown as held,
        # not free.
        for table, pool in ((blocks, dev), (cpu_blocks, cpu)):
            for b, rc in enumerate(pool.ref_counts):
                if rc and table[b] < 0:
                    table[b] = len(holders)
        shared = [[b, rc] for b, rc in enumerate(dev.ref_counts) if rc > 1]
        return {"step": core.num_steps, "t": time.time(), "num_blocks": dev.num_blocks,
                "num_cpu_blocks": cpu.num_blocks, "block_size": bm.block_size,
                "stats": core.stats(), "seqs": seqs,
                "counts": {"running": len(sched.running), "swapped": len(sched.swapped),
                           "waiting": len(sched.waiting)}, "blocks": blocks, "shared": shared,
                "cpu_blocks": cpu_blocks, "holders": list(holders)}


def _row(seq: Sequence, queue: str, holder: int) -> list[Any]:
    req = seq.request
    label = req.request_id if seq.group is None else f"{req.request_id}#{seq.index}"
    prompt = seq.num_prompt_tokens
    return [label, queue, min(seq.num_computed_tokens, prompt), prompt, seq.num_output_tokens,
            req.params.max_tokens, req.priority, int(req.events.get("preempted", 0)),
            req.num_cached_tokens, holder]
