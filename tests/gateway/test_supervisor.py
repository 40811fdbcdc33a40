"""The engine supervisor against real child processes (a fake engine): restart after SIGKILL, the
client greeted again, and a crash loop that ends in giving up."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.launcher import EngineProcess
from gateway.supervisor import EngineSupervisor, RestartPolicy, describe_exit
from shared.client import AsyncEngineClient
from tests.gateway.test_launcher import fake_engine_process

FAST = RestartPolicy(max_restarts=2, window=60.0, backoff=0.05, max_backoff=0.1, ready_timeout=30.0)


@contextlib.asynccontextmanager
async def supervised(engine: EngineProcess) -> AsyncIterator[tuple[AsyncEngineClient,
                                                                   EngineSupervisor, asyncio.Event,
                                                                   asyncio.Task[None]]]:
    """A started engine, a client that saw it ready, and a supervisor watching it (FAST policy)."""
    engine.start()
    async with AsyncEngineClient(engine.address) as client:
        await engine.wait_ready(client, timeout=30)
        sup, stop = EngineSupervisor(engine, client, FAST), asyncio.Event()
        yield client, sup, stop, asyncio.create_task(sup.supervise(stop))


async def until(pred, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy()
    assert [policy.delay(k) for k in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert (describe_exit(-signal.SIGKILL), describe_exit(3)) == ("signal=SIGKILL", "code=3")


def test_a_killed_engine_is_restarted_and_the_client_reconnects(tmp_path: Path) -> None:
    engine = fake_engine_process(tmp_path)

    async def main() -> None:
        async with supervised(engine) as (client, sup, stop, task):
            # more kills than max_restarts: each engine served, so no streak builds...
            for n in (1, 2, 3):
                assert engine.proc is not None
                old = engine.proc.pid
                os.kill(old, signal.SIGKILL)
                await until(lambda: not client.connected)
                await until(lambda old=old: client.connected and engine.proc is not None
                            and engine.proc.pid != old)
                assert sup.restarts == n and not stop.is_set()
                sup._ready_at -= FAST.window  # ...as if it had served a full window
            task.cancel()
    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_an_engine_that_cannot_start_again_is_given_up_on(tmp_path: Path) -> None:
    engine = fake_engine_process(tmp_path)

    async def main() -> None:
        async with supervised(engine) as (_, sup, stop, task):
            # e.g. its model is gone now
            engine.argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
            assert engine.proc is not None
            os.kill(engine.proc.pid, signal.SIGKILL)
            await asyncio.wait_for(stop.wait(), 60)
            await task
            assert sup.gave_up and sup.restarts == FAST.max_restarts and engine.exit_code() == 3
    try:
        asyncio.run(main())
    finally:
        engine.stop()
