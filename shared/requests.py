"""The client's one table of live requests: for each request id, the stream its caller reads and
what resuming it on another engine takes (shared/resume.py), and whether it waits for a lost engine.
Every way a request ends on this side (its finished row, an ERROR, an abort, a refusal to resume,
the resume timeout, the client closing, a hand-over to another replica) goes through
`RequestTable.end` or `take`, so nothing the client keeps per request can outlive it
(engine/requests.py is the engine's).

The gateway's Admission and Metrics stay apart: they count a gateway request (an embeddings call is
several engine requests) from before its tokenization to the end of its HTTP response.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared import protocol as P
from shared.errors import ConveyorError, EngineDead
from shared.resume import InFlight, refusal_message
from shared.stream import RequestStream


@dataclass(slots=True)
class LiveRequest:
    """What the client keeps for one request between its ADD and its last row."""

    stream: RequestStream
    flight: InFlight  # its ADD and what was delivered: what resubmitting it takes
    held: bool = False  # the engine was lost: its rows are dropped until it is resubmitted

    @property
    def request_id(self) -> str:
        return self.flight.add.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as first sent (not with the delivered tokens): what a router routes by."""
        return self.flight.add.prompt_token_ids


class RequestTable:
    """rid -> LiveRequest. The connection's reader, its lost-engine path and the client's calls
    change it only through these methods."""

    def __init__(self) -> None:
        self._live: dict[str, LiveRequest] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    @property
    def held(self) -> list[str]:
        """The requests waiting for an engine to come back, in id order."""
        return sorted(rid for rid, rec in self._live.items() if rec.held)

    def start(self, add: P.Add) -> RequestStream:
        """A new request, tracked before its ADD goes out: an engine lost meanwhile
        must find it to hold."""
        stream = RequestStream(add.request_id)
        self._live[add.request_id] = LiveRequest(stream, InFlight.of(add))
        return stream

    def end(self, request_id: str, last: P.RequestOutput | ConveyorError) -> bool:
        """The request ends here with its last row or an error, which its stream gets. -> False when
        it had ended already (idempotent)."""
        rec = self._live.pop(request_id, None)
        if rec is not None:
            rec.stream.put(last)
        return rec is not None

    def end_all(self, err: ConveyorError) -> None:
        for rid in list(self._live):
            self.end(rid, err)

    def deliver(self, out: P.RequestOutput,
                on_output: Callable[[P.RequestOutput], None] | None) -> None:
        """A row from the engine to its stream (on_output sees it first); a finished row ends
        the request. Dropped: a row for a request that ended here already (an abort before
        the engine's final row), and a lost engine's row for a held one (the resubmission
        computes those tokens again)."""
        rec = self._live.get(out.request_id)
        if rec is None or rec.held:
            return
        rec.flight.note(out)
        if on_output is not None:
            on_output(out)
        if out.finished:
            self.end(out.request_id, out)
        else:
            rec.stream.put(out)

    def hold(self, resumable: bool, reason: str) -> list[str]:
        """The engine is lost (`reason`): hold every request that can be resumed, end the others
        with EngineDead. -> the held ones."""
        for rid, rec in list(self._live.items()):
            refusal = rec.flight.refusal if resumable else "resuming is off"
            if refusal is None:
                rec.held = True
            else:
                self.end(rid, EngineDead(refusal_message(reason, refusal)))
        return self.held

    def resume(self) -> list[P.Add]:
        """An engine answered the handshake: the ADDs that continue the held requests; those that
        had nothing left to generate end with their final row (only it was lost)."""
        adds = []
        for rid in self.held:
            rec = self._live[rid]
            rec.held = False
            again = rec.flight.resubmit()
            if isinstance(again, P.Add):
                adds.append(again)
            else:
                self.end(rid, again)
        return adds

    def expire(self, err: ConveyorError) -> None:
        """The engine did not come back in time: every held request ends with err."""
        for rid in self.held:
            self.end(rid, err)

    def take_held(self) -> list[LiveRequest]:
        """The held requests, removed from this table for another client to adopt
        (their streams go on)."""
        return list(map(self._live.pop, self.held))

    def adopt(self, rec: LiveRequest) -> P.Add | None:
        """Continue another client's held request here. -> the ADD to send, or None when it had
        nothing left to generate (its stream got its final row)."""
        again = rec.flight.resubmit()
        if isinstance(again, P.RequestOutput):
            rec.stream.put(again)
            return None
        rec.held = False
        self._live[again.request_id] = rec
        return again
