"""One client's connection to one engine over ZeroMQ: the socket, the handshake, liveness, the read loop,
and resuming the requests in flight after a loss. No torch here; the calls a program makes are
AsyncEngineClient's (shared/client.py), built on this class.

One DEALER socket with a unique identity per client; the engine's ROUTER answers only this client's
requests on it. A single reader task owns receiving and dispatches each OUTPUTS row to the queue of
its request, so a slow consumer of one request never delays another (mini-sglang's request table).
A lost engine (the socket monitor sees the connection drop, a supervisor sees the process exit, missing
heartbeats show a connected engine gone silent: all call engine_lost) does not end the requests in flight:
when an engine answers the handshake again, each is resubmitted as prompt + the tokens already delivered,
and its stream simply goes on (shared/resume.py says how, and which requests cannot be resumed: those end
with EngineDead at once). A request the engine does not take back within resume_timeout ends with
EngineDead. The socket is bounded and, given keys, CURVE-authenticated (shared/wire.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import protocol as P
from shared.errors import ConveyorError, EngineDead, InvalidRequest, Overloaded, ProtocolError
from shared.resume import Resumer, refusal_message
from shared.stream import RequestStream
from shared.wire import CLIENT_MAX_MESSAGE_SIZE, DEFAULT_ENGINE_TIMEOUT, bound, connect_curve, load_keys

log = logging.getLogger(__name__)
HELLO_RETRY = 2.0  # seconds between HELLOs while the engine is lost (each READY answer is harmless)
_HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its CURVE key is not admitted",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the security mechanisms differ (CURVE keys on one side only?)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed (a wrong engine public key?)"}
Answer = TypeVar("Answer", P.Stats, P.TraceData)  # what the engine sends back to one question


def _error_from_wire(msg: P.Error) -> ConveyorError:
    if msg.status == 429:  # the wire carries no wait hint: the shortest sensible one
        return Overloaded(msg.message, retry_after=1, reason="engine")
    by_status: dict[int, type[ConveyorError]] = {400: InvalidRequest, 503: EngineDead}
    return by_status.get(msg.status, ConveyorError)(msg.message)


class EngineConnection:
    """`await start()` (or `async with`), `await close()`; between them the requests in flight (`_streams`,
    and how to resubmit each, `_resumer`) outlive a lost engine."""

    def __init__(self, address: str, *, name: str = "client", ready_timeout: float = 10.0,
                 on_output: Callable[[P.RequestOutput], None] | None = None, resume_timeout: float = 60.0,
                 curve_keys: str | os.PathLike[str] | None = None,
                 engine_timeout: float = DEFAULT_ENGINE_TIMEOUT) -> None:
        """on_output: called with every output row of this client's live requests as it arrives, before
        a slow consumer's deltas are merged (the gateway's metrics see each engine step this way).
        resume_timeout: how long requests in flight wait for a lost engine to come back (0: not at all).
        curve_keys: for an engine that requires CURVE, the DIR/client folder of `conveyor keys DIR` (a
        ValueError here says what is missing). engine_timeout: seconds without a word from an engine that
        promised heartbeats, while requests are in flight, before it counts as lost (engine_lost); it must
        exceed the engine's longest step."""
        self.address = address
        self._keys = load_keys(curve_keys, "client") if curve_keys else None
        self.engine_timeout = engine_timeout
        self._heard_at = 0.0  # loop time of the engine's last message
        self._refused: str | None = None  # why the last connection's security handshake failed
        self.on_output = on_output
        self.identity = f"{name}-{uuid.uuid4().hex[:12]}".encode()
        self.ready_timeout = ready_timeout
        self.resume_timeout = resume_timeout
        self.ready: P.Ready | None = None  # the engine's handshake answer: model name, max_model_len, limits
        self._streams: dict[str, RequestStream] = {}
        self._resumer = Resumer()  # how to resubmit each request of _streams; which wait for an engine
        self._resume_timer: asyncio.TimerHandle | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()
        # Callers waiting for the engine's answer (STATS, TRACE_DATA), in the order they asked.
        self._waiters: dict[type, deque[asyncio.Future[Any]]] = {P.Stats: deque(), P.TraceData: deque()}
        # Called with every OBSERVED message while this client observes (observe()): the gateway's dashboard.
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
        self._ctx: zmq.asyncio.Context | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, timeout: float | None = None) -> P.Ready:
        """Connect, send HELLO and wait for READY; EngineDead if none comes within the timeout."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            # Every socket of this context drops what is unsent when closed, as close() does anyway: a
            # context that is only garbage-collected then cannot block the process in term() forever.
            self._ctx.linger = 0
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.IDENTITY, self.identity)
            self._sock.setsockopt(zmq.LINGER, 0)
            bound(self._sock, CLIENT_MAX_MESSAGE_SIZE)
            if self._keys is not None:
                connect_curve(self._sock, self._keys)
            events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            for event in _HANDSHAKE_FAILED:
                events |= event
            monitor = self._sock.get_monitor_socket(events)
            self._sock.connect(self.address)
            self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._monitor_loop(monitor)),
                           asyncio.create_task(self._watch_silence())]
            await self._send(P.Hello())
        await self.wait_ready(timeout)
        assert self.ready is not None
        return self.ready

    async def close(self) -> None:
        """Idempotent. Open streams end with EngineDead; sockets close without lingering."""
        self._dead = EngineDead("client closed")
        self._fail_all(self._dead)
        if self._ctx is not None:
            # Before the monitor loop ends and closes its PAIR: an event for a closed PAIR (the engine going
            # away at this moment) blocks libzmq's I/O thread for good, and this call with it (libzmq#3575).
            self._sock.disable_monitor()
        tasks = [*self._tasks, *self._side_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def mark_dead(self, reason: str) -> None:
        """For whoever watches the engine process (the launcher): fail everything now, for good."""
        self._dead = EngineDead(reason)
        self._fail_all(self._dead)

    @property
    def connected(self) -> bool:
        """The handshake is done and the connection has not been lost since: requests can go out now."""
        return self.ready is not None and self._dead is None and not self._lost and self._ready_evt.is_set()

    async def wait_ready(self, timeout: float | None = None) -> None:
        if self._dead is not None:
            raise self._dead
        if self._ctx is None:
            raise EngineDead("client not started: call start() first")
        timeout = self.ready_timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(self._ready_evt.wait(), timeout)
        except TimeoutError:
            if self._refused is not None:
                raise EngineDead(self._refused) from None
            why = "lost the connection and it did not come back" if self._lost else "did not answer HELLO"
            hint = " (with CURVE keys: is DIR/client/engine.key this engine's public key?)" if self._keys else ""
            raise EngineDead(f"engine at {self.address} {why} within {timeout:g}s{hint}") from None
        if self._dead is not None:
            raise self._dead
        if self._refused is not None and not self.connected:
            raise EngineDead(self._refused)

    # -- a lost engine and the requests it held ------------------------------------------------------
    def engine_lost(self, reason: str) -> None:
        """The one entry point for "the engine went away" (the socket monitor, the supervisor of the engine
        process, a heartbeat): the client stops counting on the engine until one answers HELLO again.
        Requests that can be resumed are held and resubmitted then (shared/resume.py); the others, and
        stats waiters, fail now with EngineDead naming `reason`. Idempotent; safe to call while connected
        (an engine that went silent): the held requests are aborted there first, and greeted anew."""
        if self._dead is not None or self._ctx is None:
            return
        log.warning("engine lost: %s", reason)
        self._lost = True
        if self._refused is None:  # a refused handshake's disconnect: the refusal stays wait_ready()'s answer
            self._ready_evt.clear()
        for rid, refusal in self._resumer.hold(self.resume_timeout > 0).items():
            self._streams.pop(rid).put(EngineDead(refusal_message(reason, refusal)))
        self._fail_waiters(EngineDead(reason))
        # ABORT, then HELLO, on the one ordered pipe: an engine that was only silent drops the held
        # requests before it answers READY, so every row for them after READY is from the resubmission.
        msgs: list[P.Message] = [P.Hello()]
        if self._resumer.held:
            msgs.insert(0, P.Abort(sorted(self._resumer.held)))
            if self._resume_timer is None:
                self._resume_timer = asyncio.get_running_loop().call_later(self.resume_timeout, self._resume_expired)
        self._spawn(self._send_all(msgs))
        if self._resumer.held and self.on_held is not None:
            self.on_held()

    def _resume(self) -> None:
        """An engine answered the handshake after a loss: resubmit every held request still wanted."""
        self._cancel_resume_timer()
        adds, ends = self._resumer.resume(self._streams)
        for end in ends:  # every token was delivered already: only the final row was lost
            self._streams.pop(end.request_id).put(end)
        if adds:
            log.warning("resuming %d request(s) on the engine at %s", len(adds), self.address)
            self._spawn(self._send_all(list[P.Message](adds)))

    def _resume_expired(self) -> None:
        self._resume_timer = None
        err = EngineDead(f"the engine at {self.address} did not come back within {self.resume_timeout:g}s")
        for rid in self._resumer.expire():
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(err)

    def _cancel_resume_timer(self) -> None:
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None

    def _fail_all(self, err: ConveyorError) -> None:
        streams, self._streams = self._streams, {}
        self._resumer.clear()
        self._cancel_resume_timer()
        for stream in streams.values():
            stream.put(err)
        self._fail_waiters(err)
        if self._dead is not None:
            self._ready_evt.set()  # wake wait_ready() callers so that they raise _dead

    def _fail_waiters(self, err: ConveyorError) -> None:
        for waiters in self._waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(err)

    # -- the socket --------------------------------------------------------------------------------------
    async def _send(self, msg: P.Message) -> None:
        """InvalidRequest for a message over the engine's size limit (ZeroMQ would drop the whole connection
        over it); EngineDead when the engine has not taken anything from its queue for engine_timeout."""
        frames = P.encode(msg)
        limit = self.ready.max_message_size if self.ready is not None else 0
        if limit and len(frames[1]) > limit:
            raise InvalidRequest(f"this request is {len(frames[1])} bytes on the wire and the engine takes at most "
                                 f"{limit}: shorten its prompt, stop strings, stop_token_ids or logit_bias")
        try:
            sent = cast("asyncio.Future[Any]", self._sock.send_multipart(frames))
            if not sent.done():  # the queue is full: the engine is not reading
                await asyncio.wait_for(sent, self.engine_timeout)
            sent.result()
        except TimeoutError:
            raise EngineDead(f"engine at {self.address} took nothing from its queue for {self.engine_timeout:g}s "
                             "(frozen or unreachable)") from None
        except zmq.ZMQError as e:
            raise EngineDead(f"cannot send to engine at {self.address}: {e}") from None

    async def _send_all(self, msgs: list[P.Message]) -> None:
        """Sends in order; a failed send means the socket is gone, which the read loop reports."""
        with contextlib.suppress(EngineDead):
            for msg in msgs:
                await self._send(msg)

    async def _ask(self, msg: P.Message, answer: type[Answer], name: str, timeout: float) -> Answer:
        """Send msg (named `name` in errors) and wait for the engine's answer of type `answer`."""
        await self.wait_ready(timeout)
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiters[answer].append(fut)
        await self._send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise EngineDead(f"engine at {self.address} did not answer {name} within {timeout:g}s") from None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _read_loop(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart()
                self._heard_at = asyncio.get_running_loop().time()
                try:
                    msg = P.decode(frames)
                except ProtocolError as e:
                    log.warning("dropping malformed message from engine: %s", e)
                    continue
                self._dispatch(msg)
        except (zmq.ZMQError, RuntimeError) as e:  # the socket went away under us: nothing will come
            self.mark_dead(f"engine connection failed: {e}")

    def _dispatch(self, msg: P.Message) -> None:
        if isinstance(msg, P.Outputs):
            self._deliver(msg.outputs)
        elif isinstance(msg, P.Error):
            self._on_error(msg)
        elif isinstance(msg, P.Stats | P.TraceData):
            waiters = self._waiters[type(msg)]
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(msg)
                    break
        elif isinstance(msg, P.Observed):
            if self.on_observed is not None:
                self.on_observed(msg)
        elif isinstance(msg, P.Ready):
            if msg.protocol_version != P.PROTOCOL_VERSION:
                self.mark_dead(f"engine speaks protocol v{msg.protocol_version}, this client v{P.PROTOCOL_VERSION}")
            self.ready = msg
            self._lost = False
            self._ready_evt.set()
            if self._resumer.held:
                self._resume()

    def _deliver(self, outputs: list[P.RequestOutput]) -> None:
        streams, resumer, on_output = self._streams, self._resumer, self.on_output
        for out in outputs:
            stream = streams.get(out.request_id)
            # None: aborted here already, the engine's final row is late.
            if stream is None or not resumer.deliver(out):
                continue
            if on_output is not None:
                on_output(out)
            stream.put(out)
            if out.finished:
                del streams[out.request_id]

    def _on_error(self, msg: P.Error) -> None:
        stream = self._streams.pop(msg.request_id, None) if msg.request_id else None
        if msg.request_id:
            self._resumer.forget(msg.request_id)
        if stream is not None:
            stream.put(_error_from_wire(msg))
        elif self.ready is None:  # the answer to our HELLO: e.g. a protocol version it does not speak
            self.mark_dead(f"engine at {self.address} refused the handshake: {msg.message}")
        else:
            log.warning("engine error: %s", msg.message)

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self.engine_lost(f"lost connection to engine at {self.address}")
                elif event in _HANDSHAKE_FAILED:
                    self._refused = f"the engine at {self.address} refused this client: {_HANDSHAKE_FAILED[event]}"
                    log.warning("%s", self._refused)
                    self._ready_evt.set()  # wake wait_ready(), which raises it
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and (self._lost or self._refused):
                    if self._refused:
                        self._refused = None
                        self._ready_evt.clear()
                    self._lost = False
                    await self._send(P.Hello())
        finally:
            monitor.close(linger=0)

    async def _watch_silence(self) -> None:
        """With requests in flight and an engine that promised heartbeats, engine_timeout without any message
        is the engine-lost path (which aborts them there first: an engine that was only frozen frees them).
        While lost, HELLO goes again every HELLO_RETRY seconds: one that a dying connection took with it
        must not leave the client waiting for a READY that nobody will send."""
        loop, waiting_since, greeted = asyncio.get_running_loop(), None, 0.0
        while True:
            await asyncio.sleep(min(self.engine_timeout / 4, 0.5))
            if self._lost and self._dead is None and self._refused is None and \
                    loop.time() - greeted > HELLO_RETRY and not self._greeting:
                greeted = loop.time()
                self._spawn(self._greet())
            if not (self._streams and self.connected and self.ready is not None and self.ready.heartbeat_interval):
                waiting_since = None
                continue
            now = loop.time()
            waiting_since = waiting_since or now
            silent = now - max(self._heard_at, waiting_since)
            if silent > self.engine_timeout:
                waiting_since = None
                self.engine_lost(f"engine at {self.address} sent nothing for {silent:.1f}s with requests in "
                                 "flight (frozen, or its host is gone)")

    async def _greet(self) -> None:
        """One HELLO at a time: while the engine reads nothing, retries must not pile up in the queue."""
        self._greeting = True
        try:
            await self._send_all([P.Hello()])
        finally:
            self._greeting = False
