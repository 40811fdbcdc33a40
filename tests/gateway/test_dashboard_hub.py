"""The dashboard hub's engine subscription (gateway/dashboard.py) as viewers come and go: it must be
alive whenever a viewer is connected, whatever the interleaving. A viewer that joined while the
last one's stop was on its way once found no subscription at all, for good (the page stayed empty).

The client here records OBSERVE calls and holds the stop until the test lets it go, which is the
interleaving that a real socket produces only now and then."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway import dashboard
from gateway.dashboard import Hub

DEADLINE = 30.0


class RecordingClient:
    """Stands in for AsyncEngineClient: OBSERVE(0) waits on `stop_gate`; every call is recorded."""

    connected = True

    def __init__(self, fail_first: int = 0) -> None:
        self.calls: list[float] = []
        self.stop_gate = asyncio.Event()
        self.stop_started = asyncio.Event()
        self.fail_first = fail_first

    async def observe(self, seconds: float) -> None:
        self.calls.append(seconds)
        if len(self.calls) <= self.fail_first:
            raise OSError("socket error")
        if seconds == 0:
            self.stop_started.set()
            await self.stop_gate.wait()


async def until(cond: Any) -> None:
    async with asyncio.timeout(DEADLINE):
        while not cond():
            await asyncio.sleep(0.001)


@pytest.fixture(autouse=True)
def fast_renewals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dashboard, "RENEW_EVERY", 0.001)


def test_a_viewer_that_joins_while_the_stop_is_sent_keeps_a_subscription() -> None:
    async def main() -> None:
        client = RecordingClient()
        hub = Hub(client)  # type: ignore[arg-type]
        first = hub.join()
        await until(lambda: client.calls)
        hub.leave(first)
        await client.stop_started.wait()
        hub.join()  # during the stop's send
        client.stop_gate.set()
        renewals = len(client.calls)
        # the engine is asked again after the stop, and again at each renewal
        await until(lambda: len(client.calls) >= renewals + 3)
        assert client.calls[-1] == dashboard.SUBSCRIPTION
        await hub.close()

    asyncio.run(main())


def test_a_failing_observe_does_not_end_the_subscription() -> None:
    async def main() -> None:
        client = RecordingClient(fail_first=2)
        hub = Hub(client)  # type: ignore[arg-type]
        hub.join()
        await until(lambda: len(client.calls) >= 4)
        assert client.calls[:4] == [dashboard.SUBSCRIPTION] * 4
        await hub.close()

    asyncio.run(main())


def test_the_last_viewer_leaving_stops_the_engine_subscription() -> None:
    async def main() -> None:
        client = RecordingClient()
        client.stop_gate.set()
        hub = Hub(client)  # type: ignore[arg-type]
        queue = hub.join()
        await until(lambda: client.calls)
        hub.leave(queue)
        await until(lambda: hub._renewer is None)
        assert client.calls[-1] == 0
        # a new viewer starts a new subscription
        hub.join()
        await until(lambda: client.calls[-1] == dashboard.SUBSCRIPTION)
        await hub.close()

    asyncio.run(main())
