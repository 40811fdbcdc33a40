"""The engine process: a ROUTER socket around EngineCore. Moves messages; holds no scheduling logic.

Busy loop: poll the socket without waiting while there is work, block while idle (an idle engine
uses no CPU). Each step's outputs go out as one OUTPUTS message per client, holding only that
client's requests. A malformed message gets an ERROR back and is dropped; it never stops the loop.

The wire is bounded (shared/wire.py): a message over the size limit never reaches this loop (ZeroMQ
drops that connection); at most MAX_DRAIN_PER_STEP messages are taken between two steps; a client whose
output queue is full has its requests aborted and is told so once it reads again (never a silent drop).
Every HEARTBEAT_INTERVAL, from a thread of its own (engine/listener.py), each client with requests in
flight gets a HEARTBEAT.
Clients that OBSERVE get step rows and snapshots between steps (engine/observe/dashboard.py); TRACE turns a trace
on and off (engine/observe/trace.py), and --trace-file records one from the start, written when the loop ends.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections import defaultdict

import zmq

from engine.core import EngineCore
from engine.listener import Heartbeats, listen
from engine.observe.dashboard import Observer
from engine.observe.trace import Tracer
from engine.requests import RoutedOutputs
from engine.step import EngineFault
from shared.errors import ConveyorError, ProtocolError
from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Add,
    Error,
    GetStats,
    Hello,
    Message,
    Observe,
    Outputs,
    Ready,
    RequestOutput,
    ResetPrefixCache,
    Stats,
    StopChoice,
    Trace,
    TraceData,
    decode,
    encode,
)
from shared.wire import HEARTBEAT_INTERVAL, HWM, Keys, max_message_size

log = logging.getLogger("conveyor.loop")

IDLE_POLL_MS = 1000  # while idle, wake this often only to notice signals (and send heartbeats)
OBSERVED_POLL_MS = 100  # while idle and watched: the dashboard sees the last step's effects at once
# Messages taken from the socket between two steps. One costs ~10-50 us to decode and apply, so 256 add at
# most ~10 ms to a step, while being more than a step admits (max_num_seqs 128 by default): a flood waits
# for later steps instead of delaying every running request's next token without bound. The ROUTER takes
# from its clients in turn, so another client's message waits behind at most a few of the flood's.
MAX_DRAIN_PER_STEP = 256


class EngineLoop:
    def __init__(self, core: EngineCore, address: str, keys: Keys | None = None,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL, trace_file: str | None = None) -> None:
        self.core = core
        self.observer = Observer(core)
        self.trace_file = trace_file
        if trace_file is not None:
            core.set_tracer(Tracer())
        self.heartbeat_interval = heartbeat_interval
        self.address = address
        self.ctx = zmq.Context()
        self.ctx.linger = 0  # as close() does: term() never waits on unsent messages (a dead peer's)
        self.max_message_size = max_message_size(core.max_model_len)
        self.sock, self.auth = listen(self.ctx, address, keys, self.max_message_size)
        # Clients whose output queue was full: the errors they are owed, delivered once they read again.
        self.behind: dict[bytes, dict[str, Error]] = {}
        self.next_beat = 0.0
        # The socket is used from two threads (the loop, the heartbeats): every use holds this lock.
        self.lock = threading.Lock()
        self.heartbeats = Heartbeats(self.sock, self.lock, heartbeat_interval)
        self.close_linger_ms = 0  # unsent at close is dropped (a client resumes what it missed)

    def run(self) -> None:
        # The start-up heap (torch, the model, hundreds of thousands of objects) lives until exit: frozen,
        # the garbage collector stops rescanning it, so a full collection no longer stalls a step.
        gc.freeze()
        self.heartbeats.start()
        try:
            while True:
                # 1. drain the inbox: adds and aborts take effect before the next step
                busy = self.core.has_work()
                with self.lock:
                    ready = self.sock.poll(0 if busy else OBSERVED_POLL_MS if self.observer.watchers else IDLE_POLL_MS)
                if ready:
                    self._drain()
                # 2. one step: schedule, execute, update; heartbeats go on meanwhile, from their thread, to
                # every client with requests in flight (none while idle)
                self.heartbeats.targets = self.core.requests.clients() - self.behind.keys()
                if busy or self.core.has_work():
                    outputs = self._step()
                    if self.observer.watchers:
                        self.observer.on_step(outputs)
                    self._send_outputs(outputs)
                if self.observer.watchers:
                    for client, observed in self.observer.due():
                        self._send(client, observed)
                # 3. between steps, at most once per interval: the errors owed to clients that were behind
                now = time.monotonic()
                if now >= self.next_beat:
                    self.next_beat = now + self.heartbeat_interval
                    self._pay_owed_errors()
        finally:
            gc.unfreeze()  # so that exit collects it (nanobind, under triton, reports what is left as leaks)
            try:
                self._write_trace()
            finally:  # a trace that cannot be written must not leave the socket and the workers open
                self.close()

    def _write_trace(self) -> None:
        if self.trace_file is None or self.core.tracer is None:
            return
        try:
            self.core.tracer.write(self.trace_file)
        except OSError as e:  # checked at start; the folder went away since, or the disk is full
            log.error("the trace could not be written to %s: %s", self.trace_file, e)
            return
        log.info("trace written to %s", self.trace_file)

    def _step(self) -> RoutedOutputs:
        """EngineCore.step ends a request that fails inside it; this is the net under that net. A bug
        that escapes the step cannot be pinned on one request: every request in the engine ends with
        an error, its blocks freed, and the engine goes on serving new ones."""
        try:
            return self.core.step()
        except EngineFault as e:  # this process cannot compute any more: exit; clients resume
            # No ERROR to the clients: their connection drops with this process, so they hold their
            # requests and resubmit them to the engine a supervisor starts again (shared/resume.py),
            # as after a SIGKILL. A collective library's message is for this log, not for a client.
            log.error("the engine cannot go on: %s; exiting with %d requests in flight for their "
                      "clients to resume", e, len(self.core.requests))
            raise SystemExit(f"engine failed: {e}") from e
        except Exception as e:
            log.exception("the engine step failed outside any one request; ending all %d requests",
                          len(self.core.requests))
            return self.core.fail_all(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self.core.close()
        self.heartbeats.stop()
        self.sock.close(linger=self.close_linger_ms)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        if self.address.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address[len("ipc://"):])

    def _drain(self) -> None:
        for _ in range(MAX_DRAIN_PER_STEP):  # the rest waits for the next step
            try:
                with self.lock:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            client, body = frames[0], frames[1:]
            try:
                self._handle(client, decode(body))
            except ProtocolError as e:
                log.warning("bad message from %s: %s", client.hex(), e)
                self._send(client, Error(e.request_id, str(e), e.status))

    def _handle(self, client: bytes, msg: object) -> None:
        if isinstance(msg, Add):
            if client in self.behind:  # it has not read what it was sent: no new work for it
                self._owe(client, Error(msg.request_id, "", 503))
                return
            try:
                # FCFS by the engine's own clock at receipt: clients' clocks differ (and skew across machines).
                self.core.add(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority, msg.pooling, client)
            except ConveyorError as e:
                self._send(client, Error(msg.request_id, str(e), e.status))
                return
            except Exception as e:  # a check that should have refused it did not: refuse it here
                log.exception("request %s: adding it failed", msg.request_id)
                self._send(client, Error(msg.request_id, f"the engine could not add this request: {e}", 500))
        elif isinstance(msg, Abort):
            requests = self.core.requests
            self._send_outputs(self.core.abort([r for r in msg.request_ids if requests.client_of(r) == client]))
        elif isinstance(msg, StopChoice):
            if self.core.requests.client_of(msg.request_id) == client:  # as for ABORT: only its owner may
                self._send_outputs(self.core.stop_choice(msg.request_id, msg.index))
        elif isinstance(msg, Hello):
            version = msg.protocol_version
            if not isinstance(version, int) or isinstance(version, bool):
                why = f"protocol_version must be an integer, got {type(version).__name__} {version!r}"[:300]
                self._send(client, Error(None, why, 400))
                return
            if version != PROTOCOL_VERSION:
                why = f"protocol version {version} is not {PROTOCOL_VERSION}"
                self._send(client, Error(None, why, 400))
                return
            self._send(client, Ready(PROTOCOL_VERSION, self.core.source.name, self.core.max_model_len,
                                     self.max_message_size, self.heartbeat_interval, self.core.pooling.to_dict()))
        elif isinstance(msg, GetStats):
            self._send(client, Stats(self.core.stats()))
        elif isinstance(msg, ResetPrefixCache):
            self.core.reset_prefix_cache()
        elif isinstance(msg, Observe):
            self.observer.subscribe(client, msg.seconds)
        elif isinstance(msg, Trace):
            self._trace(client, msg.on)
        else:
            self._send(client, Error(None, f"the engine does not accept {type(msg).__name__} messages", 400))

    def _trace(self, client: bytes, on: bool) -> None:
        """On: record (the trace that records already, if one does). Off: answer with what was recorded,
        and stop recording unless --trace-file records for the file."""
        tracer = self.core.tracer
        if on:
            self.core.set_tracer(tracer or Tracer())
            return
        self._send(client, TraceData(tracer.trace() if tracer is not None else Tracer().trace()))
        if self.trace_file is None:
            self.core.set_tracer(None)

    def _send_outputs(self, outputs: RoutedOutputs) -> None:
        """Each output to the client that owns its request (outputs says whose: a request that ended
        has left the engine's table)."""
        by_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for out in outputs:
            assert out.request_id is not None
            client = outputs.clients[out.request_id]
            assert client is not None, "every request the loop added has its client"
            if isinstance(out, Error):  # the request failed in the engine: this is its last word
                self._send(client, out)
                continue
            by_client[client].append(out)
        for client, outs in by_client.items():
            if any(o.prompt_logprobs is not None for o in outs):  # alone, so each message stays bounded
                for o in outs:  # (engine/admission.py caps one request's prompt logprobs)
                    if o.prompt_logprobs is not None:
                        self._send(client, Outputs([o]))
                outs = [o for o in outs if o.prompt_logprobs is None]
            if outs:
                self._send(client, Outputs(outs))

    def _send(self, client: bytes, msg: Message) -> None:
        """Never blocks and never drops in silence: a client that is gone has its requests aborted; one
        whose queue is full (HWM messages it has not read) too, and it is told so (_fell_behind)."""
        if client in self.behind:
            self._owe(client, msg)
            return
        try:
            frames = [client, *encode(msg)]
            with self.lock:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self._fell_behind(client, msg)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._gone(client)

    def _gone(self, client: bytes) -> None:
        gone = self.core.requests.of_client(client)
        log.warning("client %s is gone; aborting its %d requests", client.hex(), len(gone))
        self.core.abort(gone)
        self.behind.pop(client, None)
        self.observer.drop(client)

    def _fell_behind(self, client: bytes, unsent: Message) -> None:
        """Aborting is the one bounded choice: holding its outputs here would grow without limit, and
        pausing only its requests would still hold their KV blocks. The client hears it through an
        ERROR per request, sent once it has read its queue (_beat), so no stream of its hangs."""
        mine = self.core.requests.of_client(client)
        log.warning("client %s left %d messages unread; aborting its %d requests", client.hex(), HWM, len(mine))
        self.core.abort(mine)
        self.observer.drop(client)
        self.behind[client] = {}
        self._owe(client, unsent)
        for rid in mine:
            self._owe(client, Error(rid, "", 503))

    def _owe(self, client: bytes, msg: Message) -> None:
        """A client that is behind is owed an ERROR for each request it lost: those it was sent outputs
        of, and those it adds meanwhile (refused). Other messages to it are dropped (STATS, heartbeats:
        answers it will have given up on). At most HWM are kept: its heartbeat timeout ends any other."""
        if isinstance(msg, Outputs):
            rids = [o.request_id for o in msg.outputs]
        else:
            rids = [msg.request_id] if isinstance(msg, Error) and msg.request_id else []
        owed = self.behind[client]
        for rid in rids:
            if len(owed) < HWM:
                owed[rid] = Error(rid, f"the engine aborted this request: this client left {HWM} messages "
                                       "unread (it reads its outputs too slowly, or not at all)", 503)

    def _pay_owed_errors(self) -> None:
        """The errors owed to clients that were behind, as far as their queues take them now."""
        for client, owed in list(self.behind.items()):
            del self.behind[client]  # so that _send tries the socket again
            left = list(owed.values())
            while left and client not in self.behind:
                self._send(client, left.pop(0))  # full again: _fell_behind owes that one again
            if left:
                self.behind[client].update((e.request_id, e) for e in left if e.request_id)
