"""When a client counts its engine as lost for silence, and when it greets a lost one again:
decisions only, from the loop time the connection (shared/connection.py) passes in; the
connection acts on them.

An engine that promised heartbeats (READY's heartbeat_interval) and sends nothing for engine_timeout
while requests are in flight is frozen or its host is gone: the connection's engine-lost path aborts
the requests there and holds them for a resume. While the engine is lost, HELLO goes again every
HELLO_RETRY seconds: one that a dying connection took with it must not leave the client waiting for
a READY that nobody will send.
"""
from __future__ import annotations

HELLO_RETRY = 2.0  # seconds between HELLOs while the engine is lost (each READY answer is harmless)


class Heartbeat:
    """The silence clock of one connection. `heard` on every message; `silent` and `greet_due` on
    every tick of the connection's watch."""

    def __init__(self, engine_timeout: float) -> None:
        self.engine_timeout = engine_timeout
        self.tick = min(engine_timeout / 4, 0.5)  # seconds between the watch's looks
        self._heard_at = 0.0  # loop time of the engine's last message
        # since when requests have been in flight, unbroken
        self._watching_since: float | None = None
        self._greeted = 0.0

    def heard(self, now: float) -> None:
        self._heard_at = now

    def silent(self, now: float, watching: bool) -> float | None:
        """-> how long the engine has been silent, once that passes engine_timeout while `watching`
        (requests in flight on a connected engine that promised heartbeats); None while it need not
        count as lost. Silence before the watch began does not count: an idle engine owes nobody a
        message."""
        if not watching:
            self._watching_since = None
            return None
        self._watching_since = self._watching_since or now
        silent = now - max(self._heard_at, self._watching_since)
        if silent <= self.engine_timeout:
            return None
        self._watching_since = None
        return silent

    def greet_due(self, now: float) -> bool:
        """A lost engine is due another HELLO (the caller sends it)."""
        if now - self._greeted <= HELLO_RETRY:
            return False
        self._greeted = now
        return True


def not_ready(address: str, lost: bool, curve: bool, timeout: float) -> str:
    """Why a wait for READY gave up, with what to check first."""
    why = "lost the connection and it did not come back" if lost else "did not answer HELLO"
    hint = " (with CURVE keys: is DIR/client/engine.key this engine's public key?)" if curve else ""
    return f"engine at {address} {why} within {timeout:g}s{hint}"
