"""The engine process: a ROUTER socket around EngineCore. Moves messages; holds no scheduling logic.

Busy loop: poll the socket without waiting while there is work, block while idle (an idle engine
uses no CPU). Each step's outputs go out as one OUTPUTS message per client, holding only that
client's requests (engine/outbox.py, the sending side). A malformed message gets an ERROR back and
is dropped; it never stops the loop.

The wire is bounded (shared/wire.py): a message over the size limit never reaches this loop (ZeroMQ
drops that connection); at most MAX_DRAIN_PER_STEP messages are taken between two steps; a client
whose output queue is full has its requests aborted and is told so once it reads again (never a
silent drop). Every HEARTBEAT_INTERVAL, from a thread of its own (engine/listener.py), each client
with requests in flight gets a HEARTBEAT. Clients that OBSERVE get step rows and snapshots between
steps (engine/observe/dashboard.py); TRACE turns a trace on and off (engine/observe/trace.py), and
--trace-file records one from the start, written when the loop ends.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time

import zmq

from engine.core import EngineCore
from engine.listener import Heartbeats, listen
from engine.observe.dashboard import Observer
from engine.observe.trace import Tracer
from engine.outbox import Outbox
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
    Observe,
    Ready,
    ResetPrefixCache,
    Stats,
    StopChoice,
    Trace,
    TraceData,
    decode,
)
from shared.wire import HEARTBEAT_INTERVAL, Keys, max_message_size

log = logging.getLogger("conveyor.loop")

IDLE_POLL_MS = 1000  # while idle, wake this often only to notice signals (and send heartbeats)
OBSERVED_POLL_MS = 100  # while idle and watched: the dashboard sees the last step's effects at once
# Messages taken from the socket between two steps. One costs ~10-50 us to decode and apply, so 256
# add at most ~10 ms to a step, while being more than a step admits (max_num_seqs 128 by default): a
# flood waits for later steps instead of delaying every running request's next token without bound.
# The ROUTER takes from its clients in turn, so another client's message waits behind at most a few
# of the flood's.
MAX_DRAIN_PER_STEP = 256


class EngineLoop:
    def __init__(self, core: EngineCore, address: str, keys: Keys | None = None,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 trace_file: str | None = None) -> None:
        self.core = core
        self.observer = Observer(core)
        self.trace_file = trace_file
        if trace_file is not None:
            core.set_tracer(Tracer())
        self.heartbeat_interval = heartbeat_interval
        self.address = address
        self.ctx = zmq.Context()
        self.ctx.linger = 0  # as in close(): term() never waits on a dead peer's unsent messages
        self.max_message_size = max_message_size(core.max_model_len)
        self.sock, self.auth = listen(self.ctx, address, keys, self.max_message_size)
        self.next_beat = 0.0
        # The socket is used from two threads (the loop, the heartbeats): every use holds this lock.
        self.lock = threading.Lock()
        self.heartbeats = Heartbeats(self.sock, self.lock, heartbeat_interval)
        self.outbox = Outbox(self.sock, self.lock, self._forget)
        self.close_linger_ms = 0  # unsent at close is dropped (a client resumes what it missed)

    def run(self) -> None:
        # The start-up heap (torch, the model, hundreds of thousands of objects) lives until
        # exit: frozen, the garbage collector stops rescanning it, so a full collection no longer
        # stalls a step.
        gc.freeze()
        self.heartbeats.start()
        try:
            while True:
                # 1. drain the inbox: adds and aborts take effect before the next step
                busy = self.core.has_work()
                with self.lock:
                    idle_ms = OBSERVED_POLL_MS if self.observer.watchers else IDLE_POLL_MS
                    ready = self.sock.poll(0 if busy else idle_ms)
                if ready:
                    self._drain()
                # 2. one step: schedule, execute, update; heartbeats go on meanwhile, from their
                # thread, to every client with requests in flight (none while idle)
                self.heartbeats.targets = self.core.requests.clients() - self.outbox.behind.keys()
                if busy or self.core.has_work():
                    outputs = self._step()
                    if self.observer.watchers:
                        self.observer.on_step(outputs)
                    self.outbox.send_outputs(outputs)
                if self.observer.watchers:
                    for client, observed in self.observer.due():
                        self.outbox.send(client, observed)
                # 3. between steps, at most once per interval: the errors owed to clients that
                # were behind
                now = time.monotonic()
                if now >= self.next_beat:
                    self.next_beat = now + self.heartbeat_interval
                    self.outbox.pay_owed_errors()
        finally:
            # so that exit collects it (nanobind, under triton, reports what is left as leaks)
            gc.unfreeze()
            try:
                self._write_trace()
            finally:
                # a trace that cannot be written must not leave the socket and the workers open
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
        """EngineCore.step ends a request that fails inside it; this is the net under that net. A
        bug that escapes the step cannot be pinned on one request: every request in the engine ends
        with an error, its blocks freed, and the engine goes on serving new ones."""
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
                self.outbox.send(client, Error(e.request_id, str(e), e.status))

    def _handle(self, client: bytes, msg: object) -> None:
        if isinstance(msg, Add):
            if client in self.outbox.behind:  # it has not read what it was sent: no new work for it
                self.outbox.owe(client, Error(msg.request_id, "", 503))
                return
            try:
                # FCFS by the engine's own clock at receipt: clients' clocks differ (and skew
                # across machines).
                self.core.add(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority,
                              msg.pooling, client)
            except ConveyorError as e:
                self.outbox.send(client, Error(msg.request_id, str(e), e.status))
                return
            except Exception as e:  # a check that should have refused it did not: refuse it here
                log.exception("request %s: adding it failed", msg.request_id)
                why = f"the engine could not add this request: {e}"
                self.outbox.send(client, Error(msg.request_id, why, 500))
        elif isinstance(msg, Abort):
            requests = self.core.requests
            mine = [r for r in msg.request_ids if requests.client_of(r) == client]
            self.outbox.send_outputs(self.core.abort(mine))
        elif isinstance(msg, StopChoice):
            # as for ABORT: only its owner may
            if self.core.requests.client_of(msg.request_id) == client:
                self.outbox.send_outputs(self.core.stop_choice(msg.request_id, msg.index))
        elif isinstance(msg, Hello):
            version = msg.protocol_version
            if not isinstance(version, int) or isinstance(version, bool):
                got = f"{type(version).__name__} {version!r}"
                why = f"protocol_version must be an integer, got {got}"[:300]
                self.outbox.send(client, Error(None, why, 400))
                return
            if version != PROTOCOL_VERSION:
                why = f"protocol version {version} is not {PROTOCOL_VERSION}"
                self.outbox.send(client, Error(None, why, 400))
                return
            self.outbox.send(client, Ready(PROTOCOL_VERSION, self.core.source.name,
                                           self.core.max_model_len, self.max_message_size,
                                           self.heartbeat_interval, self.core.pooling.to_dict()))
        elif isinstance(msg, GetStats):
            self.outbox.send(client, Stats(self.core.stats()))
        elif isinstance(msg, ResetPrefixCache):
            self.core.reset_prefix_cache()
        elif isinstance(msg, Observe):
            self.observer.subscribe(client, msg.seconds)
        elif isinstance(msg, Trace):
            self._trace(client, msg.on)
        else:
            why = f"the engine does not accept {type(msg).__name__} messages"
            self.outbox.send(client, Error(None, why, 400))

    def _trace(self, client: bytes, on: bool) -> None:
        """On: record (the trace that records already, if one does). Off: answer with what was
        recorded, and stop recording unless --trace-file records for the file."""
        tracer = self.core.tracer
        if on:
            self.core.set_tracer(tracer or Tracer())
            return
        trace = tracer.trace() if tracer is not None else Tracer().trace()
        self.outbox.send(client, TraceData(trace))
        if self.trace_file is None:
            self.core.set_tracer(None)

    def _forget(self, client: bytes) -> list[str]:
        """Aborts every request of a client that is gone or behind (Outbox) -> their ids."""
        mine = self.core.requests.of_client(client)
        self.core.abort(mine)
        self.observer.drop(client)
        return mine
