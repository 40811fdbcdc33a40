"""Callers of one client waiting for the engine's answer to a question (GET_STATS -> STATS, TRACE ->
TRACE_DATA). The engine answers each kind in the order it was asked, so the oldest waiter of a kind
takes the next answer of that kind; a lost or closed engine fails them all.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, TypeVar

from shared import protocol as P
from shared.errors import ConveyorError

Answer = TypeVar("Answer", P.Stats, P.TraceData)  # what the engine sends back to one question


class Questions:
    def __init__(self) -> None:
        self._waiters: dict[type, deque[asyncio.Future[Any]]] = {
            P.Stats: deque(), P.TraceData: deque()}

    def expect(self, answer: type[Answer]) -> asyncio.Future[Answer]:
        """A future for the next answer of this type (register it before the question goes out)."""
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiters[answer].append(fut)
        return fut

    def answer(self, msg: P.Stats | P.TraceData) -> None:
        """To the oldest waiter still waiting (one that timed out is skipped); unasked answers are
        dropped."""
        waiters = self._waiters[type(msg)]
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(msg)
                break

    def fail(self, err: ConveyorError) -> None:
        for waiters in self._waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(err)
