"""Stored responses (`store: true`, the default): a bounded LRU in one SQLite table.

A stored response keeps its response object (GET /v1/responses/{id}), its request's input items (GET
/v1/responses/{id}/input_items) and its conversation as chat messages (the input items after the
instructions, then the output), which `previous_response_id` continues. --responses-store-size caps
how many are kept; the least recently used goes first. One gateway keeps them in an in-memory
database of its own. `serve --gateway-workers N` gives all N processes one file (gateway/topology.py
creates its folder and removes it at stop), in WAL mode so that readers never wait for a writer:
whichever worker the kernel hands a connection to finds what another stored. Every statement is
short (one row by its key, or the eviction by the `used` index), so it runs on the event loop. Under
--cache-isolation per-key each response belongs to its API key's tenant: another key's request
reads, continues or deletes it as if it did not exist (404), as OpenAI scopes responses to a
project.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from shared.errors import ConveyorError

_SCHEMA = (
    # used: the LRU order over every process; max(used) + 1 is taken inside each write's
    # transaction.
    "CREATE TABLE IF NOT EXISTS responses (owner TEXT NOT NULL, id TEXT NOT NULL,"
    " used INTEGER NOT NULL, body BLOB NOT NULL, PRIMARY KEY (owner, id))",
    "CREATE INDEX IF NOT EXISTS responses_used ON responses (used)",
)
_NEXT = "(SELECT coalesce(max(used), 0) + 1 FROM responses)"


class NotFound(ConveyorError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code: str | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # chat messages: the conversation up to and including this output
    input_items: list[dict[str, Any]]  # this request's input items (GET .../input_items)


class ResponseStore:
    """path: the database file shared by the processes of one serve (None: in this process's
    memory).
    owner: the tenant a response belongs to (None: the one tenant of a server without per-key
    isolation)."""

    def __init__(self, size: int, path: str | None = None) -> None:
        self.size = size
        # IMMEDIATE: a write takes the lock at BEGIN, so two processes never deadlock upgrading a
        # read lock; timeout: how long a statement waits for another process's write (one row and
        # the eviction).
        self._db = sqlite3.connect(path or ":memory:", timeout=10.0, isolation_level="IMMEDIATE",
                                   check_same_thread=False)
        if path is not None:
            # persistent: the first opener switches the file
            self._db.execute("PRAGMA journal_mode=WAL")
            # a cache removed at stop: no fsync per response
            self._db.execute("PRAGMA synchronous=OFF")
        with self._db:
            for statement in _SCHEMA:
                self._db.execute(statement)

    def put(self, rid: str, stored: Stored, owner: str | None = None) -> None:
        if self.size <= 0:
            return
        body = orjson.dumps({"response": stored.response, "history": stored.history,
                             "input_items": stored.input_items})
        with self._db:
            self._db.execute(f"INSERT OR REPLACE INTO responses VALUES (?, ?, {_NEXT}, ?)",
                             (owner or "", rid, body))
            self._db.execute("DELETE FROM responses WHERE used <= (SELECT used FROM responses "
                             "ORDER BY used DESC LIMIT 1 OFFSET ?)", (self.size,))

    def find(self, rid: str, owner: str | None = None) -> Stored | None:
        """The stored response, now the most recently used; None if unknown, evicted or
        another's."""
        with self._db:
            row = self._db.execute(f"UPDATE responses SET used = {_NEXT}"
                                   " WHERE owner = ? AND id = ? RETURNING body",
                                   (owner or "", rid)).fetchone()
        if row is None:
            return None
        fields = orjson.loads(row[0])
        return Stored(fields["response"], fields["history"], fields["input_items"])

    def get(self, rid: str, param: str | None = None, owner: str | None = None) -> Stored:
        """The stored response, or NotFound (404 in OpenAI's shape)."""
        stored = self.find(rid, owner)
        if stored is None:
            raise NotFound(f"Response with id '{rid[:100]}' not found.", param=param)
        return stored

    def delete(self, rid: str, owner: str | None = None) -> None:
        with self._db:
            gone = self._db.execute("DELETE FROM responses WHERE owner = ? AND id = ?",
                                    (owner or "", rid)).rowcount
        if not gone:
            raise NotFound(f"Response with id '{rid[:100]}' not found.")

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        self._db.close()


RESPONSES = web.AppKey("responses", ResponseStore)
