"""engine/outbox.py: what a client gets when its queue is full or it is gone. The socket is a
fake whose sends fail as ZeroMQ's ROUTER_MANDATORY sends do: each case is exact, with no timing."""
from __future__ import annotations

import errno
import logging
import threading
from typing import cast

import pytest
import zmq

from engine.outbox import Outbox
from engine.requests import RoutedOutputs
from shared.protocol import Error, Message, Outputs, RequestOutput, Stats, decode
from shared.wire import HWM

A, B = b"client-a", b"client-b"


class Sock:
    """Records what reached each client; a client in `full` raises EAGAIN, one in `gone`
    EHOSTUNREACH."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []
        self.full: set[bytes] = set()
        self.gone: set[bytes] = set()

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        assert flags == zmq.NOBLOCK  # the loop never blocks on a client
        client = frames[0]
        if client in self.full:
            raise zmq.Again()
        if client in self.gone:
            raise zmq.ZMQError(errno.EHOSTUNREACH)
        self.sent.append((client, decode(frames[1:])))


def make() -> tuple[Outbox, Sock, list[bytes]]:
    sock, forgotten = Sock(), []
    mine = {A: ["a1", "a2"], B: ["b1"]}

    def forget(client: bytes) -> list[str]:
        forgotten.append(client)
        return mine.pop(client, [])  # aborted: they leave the engine's table

    return Outbox(cast(zmq.Socket[bytes], sock), threading.Lock(), forget), sock, forgotten


def row(rid: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [7], finished, "stop" if finished else None, 3)


def test_each_client_gets_one_outputs_message_with_only_its_requests() -> None:
    outbox, sock, _ = make()
    outputs = RoutedOutputs()
    outputs.add(row("a1"), A)
    outputs.add(row("b1", finished=True), B)
    outputs.add(Error("a2", "bad", 500), A)  # a failure goes alone: the request's last word
    outputs.add(row("a3"), A)
    outbox.send_outputs(outputs)
    assert sock.sent == [(A, Error("a2", "bad", 500)), (A, Outputs([row("a1"), row("a3")])),
                         (B, Outputs([row("b1", finished=True)]))]


def test_a_client_that_falls_behind_loses_its_requests_and_is_told_once_it_reads() -> None:
    outbox, sock, forgotten = make()
    sock.full.add(A)
    outbox.send(A, Outputs([row("a1")]))
    assert forgotten == [A] and A in outbox.behind
    outbox.send(A, Stats({"num_running": 1.0}))  # an answer it will have given up on: dropped
    outbox.send(A, Error("a3", "", 503))  # an ADD refused while it is behind: owed too
    outbox.send(B, Outputs([row("b1")]))  # another client is served meanwhile
    assert sock.sent == [(B, Outputs([row("b1")]))]
    outbox.pay_owed_errors()  # still full: nothing lost, still owed
    assert set(outbox.behind[A]) == {"a1", "a2", "a3"}
    sock.full.clear()
    outbox.pay_owed_errors()
    paid = [(c, m) for c, m in sock.sent if c == A]
    assert [m.request_id for _, m in paid if isinstance(m, Error)] == ["a1", "a2", "a3"]
    assert all(isinstance(m, Error) and m.status == 503 and "unread" in m.message
               for _, m in paid)
    assert not outbox.behind


def test_a_client_that_is_gone_loses_its_requests_and_is_owed_nothing() -> None:
    outbox, sock, forgotten = make()
    sock.gone.add(B)
    outbox.send(B, Outputs([row("b1")]))
    assert forgotten == [B] and not outbox.behind and not sock.sent


def test_a_client_still_behind_is_retried_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """One warning when it falls behind; each later step's retry against a full queue is silent
    (it used to log "aborting its 0 requests" every step) and aborts nothing more."""
    outbox, sock, forgotten = make()
    sock.full.add(A)
    with caplog.at_level(logging.WARNING, logger="conveyor.loop"):
        outbox.send(A, Outputs([row("a1")]))
        for _ in range(5):
            outbox.pay_owed_errors()
    assert [r.getMessage() for r in caplog.records] == [
        f"client {A.hex()} left {HWM} messages unread; aborting its 2 requests"]
    assert forgotten == [A] and set(outbox.behind[A]) == {"a1", "a2"}


def test_a_client_gone_while_owed_errors_is_dropped() -> None:
    outbox, sock, forgotten = make()
    sock.full.add(A)
    outbox.send(A, Outputs([row("a1")]))
    sock.full.clear()
    sock.gone.add(A)
    outbox.pay_owed_errors()
    assert forgotten == [A, A] and not outbox.behind and not sock.sent
