"""The engine process: a ROUTER socket around EngineCore. Moves messages; holds no scheduling logic.

Busy loop: poll the socket without waiting while there is work, block while idle (an idle engine
uses no CPU). Each step's outputs go out as one OUTPUTS message per client, holding only that
client's requests. A malformed message gets an ERROR back and is dropped; it never stops the loop.
"""
from __future__ import annotations

import gc
import logging
import os
from collections import defaultdict
from collections.abc import Sequence

import zmq

from engine.core import EngineCore
from shared.errors import ConveyorError, ProtocolError
from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Add,
    Error,
    GetStats,
    Hello,
    Message,
    Outputs,
    Ready,
    RequestOutput,
    ResetPrefixCache,
    Stats,
    StopChoice,
    decode,
    encode,
)

log = logging.getLogger("conveyor.loop")

IDLE_POLL_MS = 1000  # while idle, wake this often only to notice signals


class EngineLoop:
    def __init__(self, core: EngineCore, address: str) -> None:
        self.core = core
        self.address = address
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a full queue would silently drop a client's outputs
        self.sock.setsockopt(zmq.RCVHWM, 0)
        # Sending to a client that is gone raises instead of dropping, so its requests get aborted.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(address)
        self.owner: dict[str, bytes] = {}  # request_id -> client identity

    def run(self) -> None:
        # The start-up heap (torch, the model, hundreds of thousands of objects) lives until exit: frozen,
        # the garbage collector stops rescanning it, so a full collection no longer stalls a step.
        gc.freeze()
        try:
            while True:
                # 1. drain the inbox: adds and aborts take effect before the next step
                busy = self.core.has_work()
                if self.sock.poll(0 if busy else IDLE_POLL_MS):
                    self._drain()
                # 2. one step: schedule, execute, update
                if busy or self.core.has_work():
                    self._send_outputs(self._step())
        finally:
            gc.unfreeze()  # so that exit collects it (nanobind, under triton, reports what is left as leaks)
            self.close()

    def _step(self) -> Sequence[RequestOutput | Error]:
        """EngineCore.step ends a request that fails inside it; this is the net under that net. A bug
        that escapes the step cannot be pinned on one request: every request in the engine ends with
        an error, its blocks freed, and the engine goes on serving new ones."""
        try:
            return self.core.step()
        except Exception as e:
            log.exception("the engine step failed outside any one request; ending all %d requests",
                          len(self.core.sequences))
            return self.core.fail_all(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except FileNotFoundError:
                pass

    def _drain(self) -> None:
        while True:
            try:
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
            try:
                # FCFS by the engine's own clock at receipt: clients' clocks differ (and skew across machines).
                self.core.add(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority)
            except ConveyorError as e:
                self._send(client, Error(msg.request_id, str(e), e.status))
                return
            except Exception as e:  # a check that should have refused it did not: refuse it here
                log.exception("request %s: adding it failed", msg.request_id)
                self._send(client, Error(msg.request_id, f"the engine could not add this request: {e}", 500))
                return
            self.owner[msg.request_id] = client
        elif isinstance(msg, Abort):
            self._send_outputs(self.core.abort([r for r in msg.request_ids if self.owner.get(r) == client]))
        elif isinstance(msg, StopChoice):
            if self.owner.get(msg.request_id) == client:  # as for ABORT: only the client that owns the request
                self._send_outputs(self.core.stop_choice(msg.request_id, msg.index))
        elif isinstance(msg, Hello):
            if msg.protocol_version != PROTOCOL_VERSION:
                why = f"protocol version {msg.protocol_version} is not {PROTOCOL_VERSION}"
                self._send(client, Error(None, why, 400))
                return
            self._send(client, Ready(PROTOCOL_VERSION, self.core.source.name, self.core.max_model_len,
                                     list(self.core.eos_token_ids)))
        elif isinstance(msg, GetStats):
            self._send(client, Stats(self.core.stats()))
        elif isinstance(msg, ResetPrefixCache):
            self.core.reset_prefix_cache()
        else:
            self._send(client, Error(None, f"the engine does not accept {type(msg).__name__} messages", 400))

    def _send_outputs(self, outputs: Sequence[RequestOutput | Error]) -> None:
        by_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for out in outputs:
            assert out.request_id is not None
            if isinstance(out, Error):  # the request failed in the engine: this is its last word
                self._send(self.owner.pop(out.request_id), out)
                continue
            client = self.owner.pop(out.request_id) if out.finished else self.owner[out.request_id]
            by_client[client].append(out)
        for client, outs in by_client.items():
            self._send(client, Outputs(outs))

    def _send(self, client: bytes, msg: Message) -> None:
        try:
            self.sock.send_multipart([client, *encode(msg)])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            gone = [rid for rid, c in self.owner.items() if c == client]
            log.warning("client %s is gone; aborting its %d requests", client.hex(), len(gone))
            for rid in gone:
                del self.owner[rid]
            self.core.abort(gone)
