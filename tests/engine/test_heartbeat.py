"""Heartbeats go on while a step runs: a step longer than a client's silence timeout is an engine at
work, not a lost one. The real EngineLoop and the real SDK client over a real socket; the engine's
core is a stand-in whose first step lasts until the loop's heartbeat thread has beaten for three
timeouts."""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from engine.loop import EngineLoop
from engine.requests import LiveRequest, RequestTable, RoutedOutputs
from shared.client import AsyncEngineClient
from shared.embedding import PoolingInfo
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.fakes import Stopped, serve_in_thread

INTERVAL, TIMEOUT = 0.05, 0.5


class SlowFirstStep:
    """What EngineLoop needs of EngineCore. Every request finishes in one step; the first step waits
    for ceil(3 * TIMEOUT / INTERVAL) heartbeats, i.e. three of the client's silence timeouts."""

    max_model_len = 64
    source = SimpleNamespace(name="slow-first-step")
    # READY announces it
    pooling = PoolingInfo("", False, 0, refusal="a stand-in engine pools nothing")

    def __init__(self) -> None:
        self.adds: list[str] = []
        self.requests = RequestTable()  # the loop reads who owns what here, as of EngineCore
        self.loop: EngineLoop | None = None
        self.stop = False
        self.slow = True

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0,
            pool: object = None, client: bytes | None = None) -> None:
        self.adds.append(request_id)
        self.requests.add(request_id, LiveRequest(None, client))  # type: ignore[arg-type]  # no sequence to run

    def _end(self, request_ids: list[str], out: Callable[[str], RequestOutput]) -> RoutedOutputs:
        outs = RoutedOutputs()
        for rid in request_ids:
            live = self.requests.end(rid)
            if live is not None:
                outs.add(out(rid), live.client)
        return outs

    def abort(self, request_ids: list[str]) -> RoutedOutputs:
        return self._end(request_ids, lambda r: RequestOutput(r, [], True, "abort"))

    def has_work(self) -> bool:
        if self.stop:
            raise Stopped
        return bool(self.requests)

    def step(self) -> RoutedOutputs:
        assert self.loop is not None
        beats = math.ceil(3 * TIMEOUT / INTERVAL)
        deadline = time.monotonic() + 60
        while self.slow and self.loop.heartbeats.sent < beats and time.monotonic() < deadline:
            time.sleep(0.01)
        self.slow = False
        return self._end(list(self.requests), lambda r: RequestOutput(r, [7, 8], True, "length", 3))

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:  # the loop closes its core on the way out
        pass


def test_a_step_longer_than_the_silence_timeout_is_not_a_lost_engine(tmp_path: Path) -> None:
    core = SlowFirstStep()
    loop = EngineLoop(core, f"ipc://{tmp_path}/engine.sock", heartbeat_interval=INTERVAL)  # type: ignore[arg-type]
    core.loop = loop

    thread = serve_in_thread(loop)

    async def main() -> list[int]:
        async with AsyncEngineClient(loop.address, engine_timeout=TIMEOUT) as client:
            stream = await client.add([5, 6, 7], SamplingParams(max_tokens=2), request_id="long")
            return [t async for out in stream for t in out.new_token_ids]

    try:
        tokens = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        core.stop = True
        thread.join(30)
    # the step really outlasted the timeout
    assert loop.heartbeats.sent >= math.ceil(3 * TIMEOUT / INTERVAL)
    assert core.adds == ["long"]  # never declared lost, so never aborted and resubmitted
    assert tokens == [7, 8] and not thread.is_alive()
