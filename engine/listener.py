"""The engine's listening socket: a ROUTER, bounded (shared/wire.py), CURVE-authenticated when given
keys, and the thread that sends heartbeats on it. engine/loop.py moves the messages.
"""
from __future__ import annotations

import logging
import threading

import zmq
from zmq.auth.thread import ThreadAuthenticator

from shared.protocol import Heartbeat, encode
from shared.wire import Keys, bound, serve_curve

log = logging.getLogger("conveyor.loop")


def listen(ctx: zmq.Context[zmq.Socket[bytes]], address: str, keys: Keys | None,
           max_message_size: int) -> tuple[zmq.Socket[bytes], ThreadAuthenticator | None]:
    """-> the ROUTER bound to address, and the authenticator that admits clients when keys are given
    (the caller stops it on close). Without keys on tcp:// anyone who reaches the port is served:
    said loudly."""
    sock = ctx.socket(zmq.ROUTER)
    bound(sock, max_message_size)
    # A full queue raises (EAGAIN, the loop sends without blocking) and a client that is gone raises
    # (EHOSTUNREACH), instead of ZeroMQ dropping the message in silence: engine/outbox.py deals
    # with both.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    auth = None
    if keys is not None:  # CURVE: only clients whose public key lies in the key folder get through
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=str(keys.folder))
        serve_curve(sock, keys)
    elif address.startswith("tcp://"):
        log.warning("!!! the engine listens on %s WITHOUT authentication or encryption: anyone who "
                    "reaches this port can submit requests and read their outputs. Make keys with "
                    "`conveyor keys DIR` and start the engine with --curve-keys DIR/engine "
                    "(docs/deployment.md) !!!", address)
    sock.bind(address)
    return sock, auth


class Heartbeats(threading.Thread):
    """A HEARTBEAT to every client with requests in flight, every interval, from a thread of
    its own: it goes on while a long step runs (the forward releases the GIL), so a client's
    silence timeout tells whether the engine process is there at all, not how long a step takes
    (a float32 step of 2048 prompt tokens takes seconds on a CPU). A process that is frozen or
    gone falls silent whole."""

    def __init__(self, sock: zmq.Socket[bytes], lock: threading.Lock, interval: float) -> None:
        super().__init__(name="heartbeats", daemon=True)
        self.sock, self.lock, self.interval = sock, lock, interval
        self.targets: frozenset[bytes] = frozenset()  # set by the loop between steps, read here
        self.sent = 0  # heartbeats sent (written here only)
        self._halt = threading.Event()
        self._frames = encode(Heartbeat())

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            for client in self.targets:
                with self.lock:
                    try:
                        self.sock.send_multipart([client, *self._frames], zmq.NOBLOCK)
                    # a full queue or a client gone: the loop's next send deals with it
                    except zmq.ZMQError:
                        continue
                self.sent += 1

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join()
