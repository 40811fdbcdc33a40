"""OpenAI's Responses API: POST /v1/responses (JSON or SSE), GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items.

The request is parsed by responses_schema.py into the one internal request; the one event stream of
gateway/translate.py is rendered here as Responses events, each with its `sequence_number`:

    response.created, response.in_progress
    per reasoning (--reasoning-parser), before the message:
                  response.output_item.added {reasoning}, response.content_part.added
                  {reasoning_text}, response.reasoning_text.delta*, response.reasoning_text.done,
                  response.content_part.done, response.output_item.done
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta*,
                  response.output_text.done, response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta / .done,
                  response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut the output); `error` if
    the engine fails after the stream began.
A non-streaming response is the last event's `response`: the same renderer, so both agree. The
WebSocket mode (responses_ws.py) sends the same events, one JSON message each.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from gateway.openai_output import error_body
from gateway.responses_schema import ResponsesRequest, parse_responses
from gateway.responses_store import RESPONSES, ResponseStore, Stored
from gateway.routes import json_response, read_json, tokenizing
from gateway.state import SERVED, TENANT
from gateway.tools import ToolCall
from gateway.translate import Call, End, Started, Text, Thought, events, sse
from shared.errors import ConveyorError, InvalidRequest


def parse(app: web.Application, body: Any, local: ResponseStore | None = None,
          tenant: str | None = None) -> ResponsesRequest:
    """The body -> the request, its previous_response_id's conversation looked up first (404 if
    gone); local: a WebSocket's own responses, looked up before the server's store; tenant: the
    API key's (gateway/state.py TENANT), whose stored responses alone it sees."""
    return parse_responses(body, app[SERVED], history_of(app, body, local, tenant))


def history_of(app: web.Application, body: Any, local: ResponseStore | None = None,
               tenant: str | None = None) -> list[dict[str, Any]] | None:
    """previous_response_id's stored conversation (None without one; 404 if gone), read on the
    event loop, which alone uses this process's connection to the store."""
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    if not isinstance(prev, str):
        return None
    stored = local.find(prev) if local is not None else None
    return (stored or app[RESPONSES].get(prev, "previous_response_id", tenant)).history


async def create(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = await read_json(request)  # tokenized off the event loop, as on the chat route
    req = await tokenizing(parse_responses, body, app[SERVED],
                           history_of(app, body, None, request.get(TENANT)))
    req.parsed.tenant = request.get(TENANT)
    render = Render(app, req, f"resp_{uuid.uuid4().hex}")
    if req.stream:
        frames = ((e["type"], e) async for e in render.run())
        return await sse(request, frames, lambda err: ("error", render.error(err)))
    return json_response(await render.final())


async def retrieve(request: web.Request) -> web.Response:
    stored = request.app[RESPONSES].get(request.match_info["response_id"],
                                        owner=request.get(TENANT))
    return json_response(stored.response)


async def input_items(request: web.Request) -> web.Response:
    """One page of a stored response's input items: `limit` (1-100, default 20), `order` (asc or
    desc, the default), `after` (an item id: the page starts after it)."""
    stored = request.app[RESPONSES].get(request.match_info["response_id"],
                                        owner=request.get(TENANT))
    query = request.query
    for key in query:
        if key not in ("limit", "order", "after"):
            raise InvalidRequest(f"query parameter {key[:50]!r} is not supported", param=key[:50])
    limit = query.get("limit", "20")
    if not (limit.isdigit() and 1 <= int(limit) <= 100):
        raise InvalidRequest("limit must be an integer from 1 to 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    start = 0
    if "after" in query:
        ids = [item["id"] for item in items]
        if query["after"] not in ids:
            raise InvalidRequest(f"after: no input item {query['after'][:100]!r} in this response",
                                 param="after")
        start = ids.index(query["after"]) + 1
    page = items[start:start + int(limit)]
    return json_response({
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + len(page) < len(items),
    })


async def delete(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    request.app[RESPONSES].delete(rid, request.get(TENANT))
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


class Render:
    """One response's events, numbered; stores the response at its end when asked to."""

    def __init__(
        self,
        app: web.Application,
        req: ResponsesRequest,
        rid: str,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.app, self.req, self.rid = app, req, rid
        self.extra = extra or {}  # fields every event carries (the WebSocket mode's stream_id)
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # "message" | "reasoning": the item streaming now, if any
        self.parts: list[str] = []  # the open item's text so far
        self.calls: list[ToolCall] = []
        self.final_response: dict[str, Any] | None = None
        self.stored: Stored | None = None  # the response and its conversation, once it ended

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **fields, **self.extra}
        self.seq += 1
        return out

    def error(self, err: ConveyorError) -> dict[str, Any]:
        e = error_body(err)["error"]
        return self.event("error", code=str(e["code"]), message=e["message"], param=e["param"])

    async def final(self) -> dict[str, Any]:
        """Run to the end (non-streaming) -> the response object."""
        gen = self.run()
        try:
            async for _ in gen:
                pass
        finally:
            await gen.aclose()
        assert self.final_response is not None  # the stream ends with End, or raises
        return self.final_response

    async def run(self) -> AsyncGenerator[dict[str, Any], None]:
        source = events(self.app, self.req.parsed, self.rid)
        try:
            async for ev in source:
                if isinstance(ev, Started):
                    for kind in ("response.created", "response.in_progress"):
                        yield self.event(kind, response=self.response("in_progress"))
                elif isinstance(ev, (Thought, Text)):
                    kind = "reasoning" if isinstance(ev, Thought) else "message"
                    for out in self._delta(kind, ev.text):
                        yield out
                elif isinstance(ev, Call):
                    for out in [*self._close("completed"), *self._call(ev.call)]:
                        yield out
                elif isinstance(ev, End):
                    for out in self._end(ev):
                        yield out
        finally:
            await source.aclose()

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        """A delta of the message's text or the reasoning's: opens the item (closing the other)
        first; an empty text only opens it."""
        out = []
        if self.open != kind:
            out += self._close("completed")
            self.open, self.parts = kind, []
            prefix = _ITEMS[kind][0]
            item: dict[str, Any] = {
                "type": kind, "id": f"{prefix}_{uuid.uuid4().hex}", "status": "in_progress"}
            item |= {"role": "assistant", "content": []} if kind == "message" else {
                "summary": [], "content": []}
            self.output.append(item)
            out += [
                self.event(
                    "response.output_item.added", output_index=len(self.output) - 1, item=item
                ),
                self.event("response.content_part.added", **self._at(), part=_part(kind, "")),
            ]
        self.parts.append(text)
        if text:
            out.append(self.event(f"{_ITEMS[kind][1]}.delta", **self._at(), delta=text,
                                  **_LOGPROBS[kind]))
        return out

    def _at(self) -> dict[str, Any]:
        return {
            "item_id": self.output[-1]["id"],
            "output_index": len(self.output) - 1,
            "content_index": 0,
        }

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open message or reasoning item's closing events, if one is open."""
        kind = self.open
        if kind is None:
            return []
        text, at = "".join(self.parts), self._at()
        self.open = None
        item = {**self.output[-1], "status": status, "content": [_part(kind, text)]}
        self.output[-1] = item
        return [
            self.event(f"{_ITEMS[kind][1]}.done", **at, text=text, **_LOGPROBS[kind]),
            self.event("response.content_part.done", **at, part=_part(kind, text)),
            self.event("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        self.calls.append(call)
        item = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self.output.append(item)
        index = len(self.output) - 1
        done = {**item, "arguments": call.arguments, "status": "completed"}
        self.output[-1] = done
        at = {"item_id": item["id"], "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.function_call_arguments.delta", **at, delta=call.arguments),
            self.event(
                "response.function_call_arguments.done",
                **at,
                name=call.name,
                arguments=call.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def _end(self, end: End) -> list[dict[str, Any]]:
        cut = end.reason == "length"
        out = [] if self.output else self._delta("message", "")  # always some output
        out += self._close("incomplete" if cut else "completed")
        usage = {
            "input_tokens": end.prompt_tokens,
            "input_tokens_details": {"cached_tokens": end.cached_tokens},
            "output_tokens": end.output_tokens,
            "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
            "total_tokens": end.prompt_tokens + end.output_tokens,
        }
        final = self.response(
            "incomplete" if cut else "completed",
            usage,
            {"reason": "max_output_tokens"} if cut else None,
        )
        self.final_response = final
        self.stored = Stored(final, [*self.req.history, self._assistant()], self.req.input_items)
        if self.req.store:
            self.app[RESPONSES].put(self.rid, self.stored, self.req.parsed.tenant)
        out.append(
            self.event("response.incomplete" if cut else "response.completed", response=final)
        )
        return out

    def _assistant(self) -> dict[str, Any]:
        """This response's output as the chat message a later previous_response_id renders:
        the reasoning goes in reasoning_content (the template decides whether to show it),
        never in the content."""
        text, thought = self._joined("message"), self._joined("reasoning")
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if thought:
            msg["reasoning_content"] = thought
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        elif not text:
            msg["content"] = ""
        return msg

    def _joined(self, kind: str) -> str:
        return "".join(
            p["text"] for item in self.output if item["type"] == kind for p in item["content"]
        )

    def response(
        self,
        status: str,
        usage: dict[str, Any] | None = None,
        incomplete: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.app[SERVED].name,
            "output": list(self.output),
            "usage": usage,
            **self.req.echo,
            "truncation": "disabled",
            "background": False,
            "service_tier": "default",
        }


# item type -> (id prefix, the prefix of its text's delta / done events)
_ITEMS = {
    "message": ("msg", "response.output_text"),
    "reasoning": ("rs", "response.reasoning_text"),
}
_LOGPROBS: dict[str, dict[str, Any]] = {"message": {"logprobs": []}, "reasoning": {}}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def setup(app: web.Application, store_size: int, store_path: str | None = None) -> None:
    """The HTTP routes; OpenAI's WebSocket mode (GET /v1/responses) is gateway/responses_ws.py's.
    store_path: the store the gateway workers of one serve share (None: this process's own)."""
    app[RESPONSES] = ResponseStore(store_size, store_path)

    async def close(app: web.Application) -> None:
        app[RESPONSES].close()

    app.on_cleanup.append(close)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
    app.router.add_delete("/v1/responses/{response_id}", delete)
