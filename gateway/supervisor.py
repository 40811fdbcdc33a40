"""Keep the engine child of `conveyor serve` running: restart it when it dies, give up on a crash
loop.

Any exit of the engine while the gateway serves (SIGKILL, the OOM killer, a segfault, an exception
that left its loop) is a crash. The supervisor tells the client at once (`engine_lost`, so /ready
answers 503 and requests in flight wait to be resumed rather than fail), waits a backoff, and
starts a new engine on the same address; the client's DEALER reconnects by itself and
re-handshakes, which resumes the streams (shared/resume.py). Only the process that owns the engine
child supervises it: the other gateway workers see their connection drop and come back, and resume
their own streams the same way.

Crash loop: a crash counts toward the limit unless the engine before it had served for `window`
seconds; more than `max_restarts` such crashes in a row and the gateway exits non-zero, for the
supervisor above it (systemd, compose, Kubernetes) to act on. A fixed sliding window would miss a
slow loop (an engine that takes 20 s to load and then dies would crash three times a minute
forever); a streak reset only by healthy uptime catches both.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

from gateway.launcher import EngineProcess
from shared.client import AsyncEngineClient

log = logging.getLogger("gateway.supervisor")
POLL_S = 0.1  # how often the child is checked: its exit reaches /ready and the streams this fast


@dataclass(frozen=True)
class RestartPolicy:
    # crashes in a row the gateway restarts the engine after; 0: never restart
    max_restarts: int = 5
    window: float = 60.0  # seconds an engine must serve for its crash to start a new streak
    backoff: float = 0.5  # before the first restart; doubles per crash in the streak ...
    max_backoff: float = 8.0  # ... up to this
    # a restarted engine that neither answers HELLO nor exits by then is killed
    ready_timeout: float = 600.0

    def __post_init__(self) -> None:
        negative = any(v < 0 for v in (self.max_restarts, self.window, self.backoff))
        if negative or self.max_backoff < self.backoff:
            raise ValueError("restart policy: counts and times must be >= 0, "
                             "max_backoff >= backoff")

    def delay(self, streak: int) -> float:
        """Seconds to wait before restart number `streak` (1-based) of a streak."""
        return float(min(self.backoff * 2.0 ** (streak - 1), self.max_backoff))


def describe_exit(code: int) -> str:
    """'code=3' or 'signal=SIGKILL' (Popen reports death by signal N as -N)."""
    if code < 0:
        try:
            return f"signal={signal.Signals(-code).name}"
        except ValueError:
            return f"signal={-code}"
    return f"code={code}"


class EngineSupervisor:
    """Runs beside the HTTP server: `await supervise(stop)` returns when it gave up
    (after setting stop)."""

    def __init__(self, engine: EngineProcess, client: AsyncEngineClient,
                 policy: RestartPolicy) -> None:
        self.engine, self.client, self.policy = engine, client, policy
        self.restarts = 0  # over the gateway's life
        self.gave_up = False
        self._streak = 0
        self._ready_at = time.monotonic()  # the engine start-up waited for answered HELLO just now

    async def supervise(self, stop: asyncio.Event) -> None:
        while True:
            code = await self._wait_exit()
            self.client.engine_lost(f"the engine exited ({describe_exit(code)})")
            if time.monotonic() - self._ready_at >= self.policy.window:
                self._streak = 0
            self._streak += 1
            if self._streak > self.policy.max_restarts:
                log.error("engine_crash_loop exit=%s crashes_in_a_row=%d max_restarts=%d "
                          "window_s=%g action=give_up", describe_exit(code), self._streak,
                          self.policy.max_restarts, self.policy.window)
                self.gave_up = True
                stop.set()
                return
            delay = self.policy.delay(self._streak)
            log.warning("engine_restart exit=%s crashes_in_a_row=%d max_restarts=%d backoff_s=%g "
                        "restarts_total=%d", describe_exit(code), self._streak,
                        self.policy.max_restarts, delay, self.restarts + 1)
            await asyncio.sleep(delay)
            self.engine.start()
            self.restarts += 1
            await self._wait_ready()

    async def _wait_exit(self) -> int:
        while (code := self.engine.exit_code()) is None:
            await asyncio.sleep(POLL_S)
        return code

    async def _wait_ready(self) -> None:
        """Until the new engine answers the handshake (the client greets it by itself
        on reconnect) or exits; one that does neither within ready_timeout is killed,
        which counts as its crash."""
        deadline = time.monotonic() + self.policy.ready_timeout
        while self.engine.exit_code() is None and not self.client.connected:
            if time.monotonic() > deadline:
                log.error("engine_not_ready timeout_s=%g action=kill", self.policy.ready_timeout)
                await asyncio.to_thread(self.engine.stop)
                return
            await asyncio.sleep(POLL_S)
        if self.engine.exit_code() is None:
            self._ready_at = time.monotonic()
            log.warning("engine_ready restarts_total=%d", self.restarts)


async def stop_when_all_give_up(supervisors: list[EngineSupervisor], stop: asyncio.Event) -> None:
    """Supervises every engine, each on its own; sets stop once all have given up. One
    data-parallel replica in a crash loop leaves the ring, and the others serve on (its
    requests moved to them)."""
    events = [asyncio.Event() for _ in supervisors]
    tasks = [asyncio.create_task(s.supervise(e)) for s, e in zip(supervisors, events)]
    try:
        while not all(e.is_set() for e in events):
            await asyncio.wait([asyncio.ensure_future(e.wait()) for e in events if not e.is_set()],
                               return_when=asyncio.FIRST_COMPLETED)
            left = sum(not e.is_set() for e in events)
            if left:
                log.error("engine_out_of_service engines_left=%d action=serve_on", left)
        stop.set()
    finally:
        for t in tasks:
            t.cancel()

