"""The engine's sending side: a step's outputs, errors and answers as frames on the ROUTER, one
OUTPUTS message per client holding only that client's requests.

A send never blocks and never drops in silence. A client that is gone has its requests aborted; one
whose output queue is full (HWM messages it has not read) too, and it is owed an ERROR for each of
them, paid once it reads again (engine/loop.py calls pay_owed_errors between steps).
"""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Literal

import zmq

from engine.requests import RoutedOutputs
from shared.protocol import Error, Message, Outputs, RequestOutput, encode
from shared.wire import HWM

log = logging.getLogger("conveyor.loop")


class Outbox:
    """Frames to clients over the loop's socket. forget(client) aborts every request of a client
    that is gone or behind and returns their ids: the loop owns the core, this owns the sends."""

    def __init__(self, sock: zmq.Socket[bytes], lock: threading.Lock,
                 forget: Callable[[bytes], list[str]]) -> None:
        self.sock, self.lock, self.forget = sock, lock, forget
        # Clients whose output queue was full: the errors they are owed, paid once they read again.
        self.behind: dict[bytes, dict[str, Error]] = {}

    def send_outputs(self, outputs: RoutedOutputs) -> None:
        """Each output to the client that owns its request (outputs says whose: a request that ended
        has left the engine's table)."""
        by_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for out in outputs:
            assert out.request_id is not None
            client = outputs.clients[out.request_id]
            assert client is not None, "every request the loop added has its client"
            if isinstance(out, Error):  # the request failed in the engine: this is its last word
                self.send(client, out)
                continue
            by_client[client].append(out)
        for client, outs in by_client.items():
            # alone, so each message stays bounded
            if any(o.prompt_logprobs is not None for o in outs):
                for o in outs:  # (engine/admission.py caps one request's prompt logprobs)
                    if o.prompt_logprobs is not None:
                        self.send(client, Outputs([o]))
                outs = [o for o in outs if o.prompt_logprobs is None]
            if outs:
                self.send(client, Outputs(outs))

    def send(self, client: bytes, msg: Message) -> None:
        """Never blocks: a client gone (_gone) or behind (_fell_behind) loses its requests."""
        if client in self.behind:
            self.owe(client, msg)
        elif self._deliver(client, msg) == "full":
            self._fell_behind(client, msg)

    def _deliver(self, client: bytes, msg: Message) -> Literal["sent", "full", "gone"]:
        try:
            with self.lock:
                self.sock.send_multipart([client, *encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            return "full"
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._gone(client)
            return "gone"
        return "sent"

    def _gone(self, client: bytes) -> None:
        gone = self.forget(client)
        log.warning("client %s is gone; aborting its %d requests", client.hex(), len(gone))
        self.behind.pop(client, None)

    def _fell_behind(self, client: bytes, unsent: Message) -> None:
        """Aborting is the one bounded choice: holding its outputs here would grow without limit,
        and pausing only its requests would still hold their KV blocks. The client hears it through
        an ERROR per request, sent once it has read its queue (pay_owed_errors), so no stream of its
        hangs."""
        mine = self.forget(client)
        log.warning("client %s left %d messages unread; aborting its %d requests",
                    client.hex(), HWM, len(mine))
        self.behind[client] = {}
        self.owe(client, unsent)
        for rid in mine:
            self.owe(client, Error(rid, "", 503))

    def owe(self, client: bytes, msg: Message) -> None:
        """A client that is behind is owed an ERROR for each request it lost: those it was sent
        outputs of, and those it adds meanwhile (refused). Other messages to it are dropped (STATS,
        heartbeats: answers it will have given up on). At most HWM are kept: its heartbeat timeout
        ends any other."""
        if isinstance(msg, Outputs):
            rids = [o.request_id for o in msg.outputs]
        else:
            rids = [msg.request_id] if isinstance(msg, Error) and msg.request_id else []
        owed = self.behind[client]
        for rid in rids:
            if len(owed) < HWM:
                why = (f"the engine aborted this request: this client left {HWM} messages "
                       "unread (it reads its outputs too slowly, or not at all)")
                owed[rid] = Error(rid, why, 503)

    def pay_owed_errors(self) -> None:
        """The errors owed to clients that were behind, as far as their queues take them now. A
        queue still full is not news: the client stays behind, quietly, until it reads."""
        for client, owed in list(self.behind.items()):
            for rid, error in list(owed.items()):
                if self._deliver(client, error) != "sent":
                    break
                del owed[rid]
            else:
                del self.behind[client]
