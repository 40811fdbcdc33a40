"""Stored responses (`store: true`, the default): a bounded in-memory LRU per gateway process.

A stored response keeps its response object (GET /v1/responses/{id}), its request's input items
(GET /v1/responses/{id}/input_items) and its conversation as chat messages (the input items after
the instructions, then the output), which `previous_response_id` continues.
--responses-store-size caps how many are kept; the least recently used goes first. With several
gateway workers each process has its own store (docs/api.md). Under --cache-isolation per-key each
response belongs to its API key's tenant: another key's request reads, continues or deletes it as if
it did not exist (404), as OpenAI scopes responses to a project.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from shared.errors import ConveyorError


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
    """owner: the tenant a response belongs to (None: the one tenant of a server without per-key
    isolation)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, str], Stored] = OrderedDict()

    def put(self, rid: str, stored: Stored, owner: str | None = None) -> None:
        if self.size <= 0:
            return
        key = (owner or "", rid)
        self._items[key] = stored
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def find(self, rid: str, owner: str | None = None) -> Stored | None:
        key = (owner or "", rid)
        stored = self._items.get(key)
        if stored is not None:
            self._items.move_to_end(key)
        return stored

    def get(self, rid: str, param: str | None = None, owner: str | None = None) -> Stored:
        """The stored response, or NotFound (404 in OpenAI's shape)."""
        stored = self.find(rid, owner)
        if stored is None:
            raise NotFound(f"Response with id '{rid[:100]}' not found.", param=param)
        return stored

    def delete(self, rid: str, owner: str | None = None) -> None:
        if self._items.pop((owner or "", rid), None) is None:
            raise NotFound(f"Response with id '{rid[:100]}' not found.")

    def __len__(self) -> int:
        return len(self._items)


RESPONSES = web.AppKey("responses", ResponseStore)
