"""Connections that hold the gateway without ever making a request: a header timeout and a
connection cap, each logging what it does.

aiohttp closes an idle keep-alive connection, but not one that never finished its first request's
headers: 600-3,000 clients sending half a header stayed open indefinitely, and 21,000 exhausted the
file descriptors (`/health` stopped answering, with nothing logged). The API key cannot help: it is
checked after the headers. So each connection must finish its first request's headers within
`header_timeout` seconds of connecting, and past `max_connections` open ones a new connection is
closed at once. The body of a request has its own timeout, where it is read (gateway/routes.py
read_json).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("gateway.connections")
LOG_EVERY = 5.0  # seconds between two log lines of one kind: a flood is summarized, not echoed


@dataclass
class ConnectionGuard:
    header_timeout: float = 15.0
    max_connections: int = 10_000
    # what was closed since the last log line, by why
    counts: dict[str, int] = field(default_factory=dict)
    logged_at: dict[str, float] = field(default_factory=dict)

    def closed(self, why: str) -> None:
        """Count one closed connection; log the count at most every LOG_EVERY seconds per reason."""
        self.counts[why] = self.counts.get(why, 0) + 1
        now = time.monotonic()
        if now - self.logged_at.get(why, 0.0) >= LOG_EVERY:
            log.warning("closed %d connection(s) that %s", self.counts[why], why)
            self.logged_at[why], self.counts[why] = now, 0


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with the header timeout and the cap (one per connection)."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        g = self.guard
        assert self._manager is not None
        if len(self._manager.connections) > g.max_connections:
            g.closed(f"came past the cap of {g.max_connections} open connections "
                     "(--max-connections)")
            self.force_close()
            return
        loop = asyncio.get_running_loop()
        self.header_timer = loop.call_later(g.header_timeout, self._no_headers)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # a whole request head has arrived
        if self.header_timer is not None and self._request_count:
            self.header_timer.cancel()
            self.header_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        super().connection_lost(exc)

    def _no_headers(self) -> None:
        self.header_timer = None
        self.guard.closed(f"did not send a request's headers within {self.guard.header_timeout:g}s "
                          "(--header-timeout)")
        self.force_close()


class GuardedServer(web.Server):
    guard: ConnectionGuard

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, guard=self.guard, loop=self._loop, **self._kwargs)


def guard(runner: web.AppRunner, config: ConnectionGuard) -> None:
    """After runner.setup(), before any site starts: its connections get GuardedHandler."""
    server = runner.server
    assert server is not None
    server.__class__ = GuardedServer  # the instance AppRunner built, with our protocol factory
    server.guard = config  # type: ignore[attr-defined]
