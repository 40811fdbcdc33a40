"""The engine's one table of live requests: for each request id, its root sequence, the client that
sent it and the grammar compile it waits for. Every way a request ends (it finishes, it is aborted,
its client goes, its step fails, its grammar does not compile, the engine ends every request) goes
through `RequestTable.end`, so nothing the engine keeps per request can outlive it. The scheduler's
queues and the block manager hold sequences, not requests: EngineCore ends those in the same call.

The table writes only its own records; a Sequence's fields stay the scheduler's."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.sequence import Sequence
from shared.protocol import Error, RequestOutput


@dataclass
class LiveRequest:
    """What the engine keeps for one request between its ADD and its last output."""

    root: Sequence  # its first sequence (a group's others hang off root.group)
    client: bytes | None = None  # the client that owns it (EngineLoop); None in-process
    grammar: Future[Any] | None = None  # its constraint compiling: in no scheduler queue until done


class RequestTable(Mapping[str, LiveRequest]):
    """rid -> LiveRequest. A Mapping to read; add / compiled / end to change."""

    def __init__(self) -> None:
        self._live: dict[str, LiveRequest] = {}
        # the records whose grammar is not compiled yet
        self._compiling: dict[str, LiveRequest] = {}

    def __getitem__(self, request_id: str) -> LiveRequest:
        return self._live[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: str, record: LiveRequest) -> None:
        assert request_id not in self._live, "EngineCore.add refuses an id in use"
        self._live[request_id] = record
        if record.grammar is not None:
            self._compiling[request_id] = record

    def end(self, request_id: str) -> LiveRequest | None:
        """The request leaves the table. -> its record (None when it was not live), for the caller
        to release what the record names."""
        self._compiling.pop(request_id, None)
        return self._live.pop(request_id, None)

    def compiled(self, request_id: str) -> None:
        """Its grammar is ready: it waits for nothing now (it goes to the scheduler)."""
        self._compiling.pop(request_id).grammar = None

    def compiling(self) -> dict[str, Future[Any]]:
        """The requests that wait for their grammar, and the compile each waits for."""
        return {rid: r.grammar for rid, r in self._compiling.items() if r.grammar is not None}

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def client_of(self, request_id: str) -> bytes | None:
        record = self._live.get(request_id)
        return record.client if record is not None else None

    def of_client(self, client: bytes) -> list[str]:
        """The live requests client owns."""
        return [rid for rid, r in self._live.items() if r.client == client]

    def clients(self) -> frozenset[bytes]:
        """The clients with a request in flight (those the heartbeats go to)."""
        return frozenset(r.client for r in self._live.values() if r.client is not None)


class RoutedOutputs(list[RequestOutput | Error]):
    """What one engine call gives its requests' clients, with the client of each request in it: a
    request that ended in the call has left the table, so whoever routes outputs (Outbox) reads
    its client here, by value."""

    def __init__(self) -> None:
        super().__init__()
        self.clients: dict[str, bytes | None] = {}

    def add(self, out: RequestOutput | Error, client: bytes | None) -> None:
        assert out.request_id is not None
        self.append(out)
        self.clients[out.request_id] = client
