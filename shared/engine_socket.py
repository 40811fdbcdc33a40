"""The socket under one client's connection (shared/connection.py): a DEALER with this client's
identity, bounded and, given keys, CURVE-authenticated (shared/wire.py), with a monitor that reports
the connection's drops and failed security handshakes. It moves messages only; what they mean is the
connection's business.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import protocol as P
from shared.errors import EngineDead, InvalidRequest, ProtocolError
from shared.wire import CLIENT_MAX_MESSAGE_SIZE, Keys, bound, connect_curve

log = logging.getLogger(__name__)
HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its CURVE key is not admitted",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the security mechanisms differ (CURVE keys on one side "
                                         "only?)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed (a wrong engine public key?)"}


class EngineSocket:
    """Connected at construction; `close()` drops what is unsent."""

    def __init__(self, address: str, identity: bytes, keys: Keys | None,
                 engine_timeout: float) -> None:
        """engine_timeout: how long a send may wait for room in a full queue (an engine not
        reading)."""
        self.address, self.engine_timeout = address, engine_timeout
        self._ctx = zmq.asyncio.Context()
        # Every socket of this context drops what is unsent when closed, as close() does anyway: a
        # context that is only garbage-collected then cannot block the process in term() forever.
        self._ctx.linger = 0
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.setsockopt(zmq.LINGER, 0)
        bound(self._sock, CLIENT_MAX_MESSAGE_SIZE)
        if keys is not None:
            connect_curve(self._sock, keys)
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        for event in HANDSHAKE_FAILED:
            events |= event
        self._monitor = self._sock.get_monitor_socket(events)
        self._sock.connect(address)

    async def send(self, msg: P.Message, limit: int) -> None:
        """InvalidRequest for a message over the engine's size limit (ZeroMQ would drop the whole
        connection over it; 0: none known yet); EngineDead when the engine has not taken anything
        from its queue for engine_timeout."""
        frames = P.encode(msg)
        if limit and len(frames[1]) > limit:
            raise InvalidRequest(f"this request is {len(frames[1])} bytes on the wire and the "
                                 f"engine takes at most {limit}: shorten its prompt, stop strings, "
                                 "stop_token_ids or logit_bias")
        try:
            sent = cast("asyncio.Future[Any]", self._sock.send_multipart(frames))
            if not sent.done():  # the queue is full: the engine is not reading
                await asyncio.wait_for(sent, self.engine_timeout)
            sent.result()
        except TimeoutError:
            raise EngineDead(f"engine at {self.address} took nothing from its queue for "
                             f"{self.engine_timeout:g}s (frozen or unreachable)") from None
        except zmq.ZMQError as e:
            raise EngineDead(f"cannot send to engine at {self.address}: {e}") from None

    async def recv(self) -> P.Message | None:
        """The next message; None for a malformed one (dropped). zmq.ZMQError when the socket is
        gone."""
        frames = await self._sock.recv_multipart()
        try:
            return P.decode(frames)
        except ProtocolError as e:
            log.warning("dropping malformed message from engine: %s", e)
            return None

    async def event(self) -> int:
        """The monitor's next event: zmq.EVENT_DISCONNECTED, _HANDSHAKE_SUCCEEDED or one of
        HANDSHAKE_FAILED."""
        return int(parse_monitor_message(await self._monitor.recv_multipart())["event"])

    def stop_monitor(self) -> None:
        """Before whoever awaits event() stops and closes the monitor: an event for a closed PAIR
        (the engine going away at this moment) blocks libzmq's I/O thread for good, and close() with
        it (libzmq#3575)."""
        self._sock.disable_monitor()

    def close_monitor(self) -> None:
        self._monitor.close(linger=0)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
