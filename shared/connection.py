"""One client's connection to one engine over ZeroMQ: the socket, the handshake, liveness, the read
loop, and resuming the requests in flight after a loss. No torch here; the calls a program makes are
AsyncEngineClient's (shared/client.py), built on this class.

One DEALER socket with a unique identity per client (shared/engine_socket.py); the engine's ROUTER
answers only this client's requests on it. A single reader task owns receiving and dispatches each
OUTPUTS row to the stream of its request in the one table of live requests (shared/requests.py), so
a slow consumer of one request never delays another. A lost engine
(the socket monitor sees the connection drop, a supervisor sees the process exit, missing heartbeats
show a connected engine gone silent: all call engine_lost) does not end the requests in flight: when
an engine answers the handshake again, each is resubmitted as prompt + the tokens already delivered,
and its stream simply goes on (shared/resume.py says how, and which requests cannot be resumed:
those end with EngineDead at once). A request the engine does not take back within resume_timeout
ends with EngineDead.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from shared import protocol as P
from shared.engine_socket import HANDSHAKE_FAILED, EngineSocket
from shared.errors import ConveyorError, EngineDead, InvalidRequest, Overloaded
from shared.heartbeat import Heartbeat, not_ready
from shared.questions import Answer, Questions
from shared.requests import RequestTable
from shared.wire import DEFAULT_ENGINE_TIMEOUT, load_keys

log = logging.getLogger(__name__)


def _error_from_wire(msg: P.Error) -> ConveyorError:
    if msg.status == 429:  # the wire carries no wait hint: the shortest sensible one
        return Overloaded(msg.message, retry_after=1, reason="engine")
    by_status: dict[int, type[ConveyorError]] = {400: InvalidRequest, 503: EngineDead}
    return by_status.get(msg.status, ConveyorError)(msg.message)


class EngineConnection:
    """`await start()` (or `async with`), `await close()`; between them the requests in flight
    (`_requests`: each one's stream and how to resubmit it) outlive a lost engine."""

    def __init__(self, address: str, *, name: str = "client", ready_timeout: float = 10.0,
                 on_output: Callable[[P.RequestOutput], None] | None = None,
                 resume_timeout: float = 60.0, curve_keys: str | os.PathLike[str] | None = None,
                 engine_timeout: float = DEFAULT_ENGINE_TIMEOUT) -> None:
        """on_output: called with every output row of this client's live requests as it arrives,
        before a slow consumer's deltas are merged (the gateway's metrics see each engine step this
        way).
        resume_timeout: how long requests in flight wait for a lost engine to come back (0: not at
        all).
        curve_keys: for an engine that requires CURVE, the DIR/client folder of `conveyor keys DIR`
        (a ValueError here says what is missing). engine_timeout: seconds without a word from an
        engine that promised heartbeats, while requests are in flight, before it counts as lost
        (engine_lost); it must exceed the engine's longest step."""
        self.address = address
        self._keys = load_keys(curve_keys, "client") if curve_keys else None
        self.engine_timeout = engine_timeout
        # when silence means a lost engine (shared/heartbeat.py)
        self._beat = Heartbeat(engine_timeout)
        self._refused: str | None = None  # why the last connection's security handshake failed
        self.on_output = on_output
        self.identity = f"{name}-{uuid.uuid4().hex[:12]}".encode()
        self.ready_timeout = ready_timeout
        self.resume_timeout = resume_timeout
        # the engine's handshake answer: model name, max_model_len, limits
        self.ready: P.Ready | None = None
        self._requests = RequestTable()
        self._resume_timer: asyncio.TimerHandle | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._questions = Questions()  # callers waiting for STATS, TRACE_DATA
        # Called with every OBSERVED message while this client observes (observe()): the gateway's
        # dashboard.
        self.on_observed: Callable[[P.Observed], None] | None = None
        # Called when the engine is lost with requests held for resuming: a router of several
        # replicas moves them to a live one at once (AsyncEngineClient.hand_over / adopt) instead of
        # waiting for this one's return.
        self.on_held: Callable[[], None] | None = None
        self._ready_evt = asyncio.Event()
        self._dead: EngineDead | None = None  # set for good by mark_dead() or a protocol mismatch
        self._lost = False  # disconnected since the last handshake: greet the next connection
        self._greeting = False  # a retried HELLO is on its way (_greet)
        self._tasks: list[asyncio.Task[None]] = []
        self._sock: EngineSocket | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, timeout: float | None = None) -> P.Ready:
        """Connect, send HELLO and wait for READY; EngineDead if none comes within the timeout."""
        if self._sock is None:
            self._sock = EngineSocket(self.address, self.identity, self._keys, self.engine_timeout)
            self._tasks = [asyncio.create_task(self._read_loop()),
                           asyncio.create_task(self._monitor_loop(self._sock)),
                           asyncio.create_task(self._watch_silence())]
            await self._send(P.Hello())
        await self.wait_ready(timeout)
        assert self.ready is not None
        return self.ready

    async def close(self) -> None:
        """Idempotent. Open streams end with EngineDead; sockets close without lingering."""
        self._dead = EngineDead("client closed")
        self._fail_all(self._dead)
        if self._sock is not None:
            self._sock.stop_monitor()  # before the monitor loop ends
        tasks = [*self._tasks, *self._side_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def mark_dead(self, reason: str) -> None:
        """For whoever watches the engine process (the launcher): fail everything now, for good."""
        self._dead = EngineDead(reason)
        self._fail_all(self._dead)

    @property
    def connected(self) -> bool:
        """The handshake is done and the connection has not been lost since: requests can go out
        now."""
        up = self._dead is None and not self._lost
        return self.ready is not None and up and self._ready_evt.is_set()

    async def wait_ready(self, timeout: float | None = None) -> None:
        if self._dead is not None:
            raise self._dead
        if self._sock is None:
            raise EngineDead("client not started: call start() first")
        timeout = self.ready_timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(self._ready_evt.wait(), timeout)
        except TimeoutError:
            if self._refused is not None:
                raise EngineDead(self._refused) from None
            why = not_ready(self.address, self._lost, self._keys is not None, timeout)
            raise EngineDead(why) from None
        if self._dead is not None:
            raise self._dead
        if self._refused is not None and not self.connected:
            raise EngineDead(self._refused)

    # -- a lost engine and the requests it held ----------------------------------------------------
    def engine_lost(self, reason: str) -> None:
        """The one entry point for "the engine went away" (the socket monitor, the supervisor of the
        engine process, a heartbeat): the client stops counting on the engine until one answers
        HELLO again. Requests that can be resumed are held and resubmitted then (shared/resume.py);
        the others, and stats waiters, fail now with EngineDead naming `reason`. Idempotent; safe to
        call while connected (an engine that went silent): the held requests are aborted there
        first, and greeted anew."""
        if self._dead is not None or self._sock is None:
            return
        log.warning("engine lost: %s", reason)
        self._lost = True
        # a refused handshake's disconnect: the refusal stays wait_ready()'s answer
        if self._refused is None:
            self._ready_evt.clear()
        held = self._requests.hold(self.resume_timeout > 0, reason)
        self._questions.fail(EngineDead(reason))
        # ABORT, then HELLO, on the one ordered pipe: an engine that was only silent drops the held
        # requests before it answers READY, so every row for them after READY is from the
        # resubmission.
        msgs: list[P.Message] = [P.Hello()]
        if held:
            msgs.insert(0, P.Abort(held))
            if self._resume_timer is None:
                self._resume_timer = asyncio.get_running_loop().call_later(self.resume_timeout,
                                                                           self._resume_expired)
        self._spawn(self._send_all(msgs))
        if held and self.on_held is not None:
            self.on_held()

    def _resume(self) -> None:
        """An engine answered the handshake after a loss: resubmit every held request still
        wanted."""
        self._cancel_resume_timer()
        adds = self._requests.resume()
        if adds:
            log.warning("resuming %d request(s) on the engine at %s", len(adds), self.address)
            self._spawn(self._send_all(list[P.Message](adds)))

    def _resume_expired(self) -> None:
        self._resume_timer = None
        self._requests.expire(
            EngineDead(f"the engine at {self.address} did not come back within "
                       f"{self.resume_timeout:g}s"))

    def _cancel_resume_timer(self) -> None:
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None

    def _fail_all(self, err: ConveyorError) -> None:
        self._requests.end_all(err)
        self._cancel_resume_timer()
        self._questions.fail(err)
        if self._dead is not None:
            self._ready_evt.set()  # wake wait_ready() callers so that they raise _dead

    # -- the socket --------------------------------------------------------------------------------
    async def _send(self, msg: P.Message) -> None:
        """EngineSocket.send under the size limit the engine announced."""
        if self._sock is None:
            raise EngineDead("client closed")
        await self._sock.send(msg, self.ready.max_message_size if self.ready is not None else 0)

    async def _send_all(self, msgs: list[P.Message]) -> None:
        """Sends in order; a failed send means the socket is gone, which the read loop reports."""
        with contextlib.suppress(EngineDead):
            for msg in msgs:
                await self._send(msg)

    async def _ask(self, msg: P.Message, answer: type[Answer], name: str, timeout: float) -> Answer:
        """Send msg (named `name` in errors) and wait for the engine's answer of type `answer`."""
        await self.wait_ready(timeout)
        fut = self._questions.expect(answer)
        await self._send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            why = f"engine at {self.address} did not answer {name} within {timeout:g}s"
            raise EngineDead(why) from None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _read_loop(self) -> None:
        try:
            while self._sock is not None:
                msg = await self._sock.recv()
                self._beat.heard(asyncio.get_running_loop().time())
                if msg is not None:
                    self._dispatch(msg)
        # the socket went away under us: nothing will come
        except (zmq.ZMQError, RuntimeError) as e:
            self.mark_dead(f"engine connection failed: {e}")

    def _dispatch(self, msg: P.Message) -> None:
        if isinstance(msg, P.Outputs):
            for out in msg.outputs:
                self._requests.deliver(out, self.on_output)
        elif isinstance(msg, P.Error):
            self._on_error(msg)
        elif isinstance(msg, P.Stats | P.TraceData):
            self._questions.answer(msg)
        elif isinstance(msg, P.Observed):
            if self.on_observed is not None:
                self.on_observed(msg)
        elif isinstance(msg, P.Ready):
            if msg.protocol_version != P.PROTOCOL_VERSION:
                self.mark_dead(f"engine speaks protocol v{msg.protocol_version}, this client "
                               f"v{P.PROTOCOL_VERSION}")
            self.ready = msg
            self._lost = False
            self._ready_evt.set()
            if self._requests.held:
                self._resume()

    def _on_error(self, msg: P.Error) -> None:
        if msg.request_id and self._requests.end(msg.request_id, _error_from_wire(msg)):
            return
        if self.ready is None:  # the answer to our HELLO: e.g. a protocol version it does not speak
            self.mark_dead(f"engine at {self.address} refused the handshake: {msg.message}")
        else:
            log.warning("engine error: %s", msg.message)

    async def _monitor_loop(self, sock: EngineSocket) -> None:
        try:
            while True:
                event = await sock.event()
                if event == zmq.EVENT_DISCONNECTED:
                    self.engine_lost(f"lost connection to engine at {self.address}")
                elif event in HANDSHAKE_FAILED:
                    self._refused = (f"the engine at {self.address} refused this client: "
                                     f"{HANDSHAKE_FAILED[event]}")
                    log.warning("%s", self._refused)
                    self._ready_evt.set()  # wake wait_ready(), which raises it
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and (self._lost or self._refused):
                    if self._refused:
                        self._refused = None
                        self._ready_evt.clear()
                    self._lost = False
                    await self._send(P.Hello())
        finally:
            sock.close_monitor()

    async def _watch_silence(self) -> None:
        """The heartbeat's decisions acted on: a silent engine is lost; a lost one is greeted
        again."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._beat.tick)
            now = loop.time()
            if self._lost and self._dead is None and self._refused is None and not self._greeting \
                    and self._beat.greet_due(now):
                self._spawn(self._greet())
            beats = bool(self.ready and self.ready.heartbeat_interval)
            watching = bool(self._requests) and self.connected and beats
            if (silent := self._beat.silent(now, watching)) is not None:
                self.engine_lost(f"engine at {self.address} sent nothing for {silent:.1f}s with "
                                 "requests in flight (frozen, or its host is gone)")

    async def _greet(self) -> None:
        """One HELLO at a time: while the engine reads nothing, retries must not pile up in the
        queue."""
        self._greeting = True
        try:
            await self._send_all([P.Hello()])
        finally:
            self._greeting = False
