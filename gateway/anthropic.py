"""Anthropic's Messages API: POST /v1/messages (JSON or SSE) and POST /v1/messages/count_tokens.

The body is parsed by anthropic_schema.py into the one internal request; the one event stream of
gateway/translate.py is rendered here in Anthropic's shapes:

    message_start, ping
    per thinking block (--reasoning-parser), before the text:
                     content_block_start {thinking, signature ""},
                     content_block_delta {thinking_delta}*, content_block_stop
    per text block:  content_block_start {text}, content_block_delta {text_delta}*,
                     content_block_stop
    per tool call:   content_block_start {tool_use}, content_block_delta {input_json_delta},
                     content_block_stop
    message_delta {stop_reason, stop_sequence, usage.output_tokens}, message_stop
A non-streaming message is what the same renderer gathered. stop_reason: tool_use (the output is
calls), max_tokens (cut by max_tokens), stop_sequence (one of stop_sequences, named in
stop_sequence), else end_turn. Errors, on these routes only, are Anthropic's
{"type": "error", "error": {"type", "message"}} (app.py's middleware asks anthropic_error_body).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from gateway.anthropic_schema import MessagesRequest, parse_messages_body
from gateway.routes import json_response, read_json, tokenizing
from gateway.state import SERVED, TENANT
from gateway.translate import Call, End, Frame, Started, Text, Thought, events, sse
from shared.errors import ConveyorError

PREFIX = "/v1/messages"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(err: ConveyorError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": _TYPES.get(err.status, "api_error"), "message": str(err)},
    }


async def create(request: web.Request) -> web.StreamResponse:
    app = request.app
    req = await tokenizing(parse_messages_body, await read_json(request), app[SERVED])
    req.parsed.tenant = request.get(TENANT)
    render = Render(app, req, f"msg_{uuid.uuid4().hex}")
    if req.stream:
        return await sse(request, render.run(), lambda err: ("error", anthropic_error_body(err)))
    gen = render.run()
    try:
        async for _ in gen:
            pass
    finally:
        await gen.aclose()
    return json_response(render.message)


async def count_tokens(request: web.Request) -> web.Response:
    req = await tokenizing(parse_messages_body, await read_json(request), request.app[SERVED],
                           count=True)
    return json_response({"input_tokens": len(req.parsed.prompt_token_ids)})


class Render:
    """One message's SSE frames; `message` is the whole message, complete once the frames end."""

    def __init__(self, app: web.Application, req: MessagesRequest, mid: str) -> None:
        self.app, self.req = app, req
        self.message: dict[str, Any] = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": app[SERVED].name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": None,
        }
        self.open: str | None = None  # "text" | "thinking": the last block, while it streams

    async def run(self) -> AsyncGenerator[Frame, None]:
        source = events(self.app, self.req.parsed, self.message["id"])
        try:
            async for ev in source:
                if isinstance(ev, Started):
                    self.message["usage"] = _usage(ev.prompt_tokens, ev.cached_tokens, 0)
                    yield (
                        "message_start",
                        {"type": "message_start", "message": {**self.message, "content": []}},
                    )
                    yield "ping", {"type": "ping"}
                elif isinstance(ev, (Thought, Text)):
                    kind = "thinking" if isinstance(ev, Thought) else "text"
                    for frame in self._delta(kind, ev.text):
                        yield frame
                elif isinstance(ev, Call):
                    for frame in [*self._close(), *self._call(ev)]:
                        yield frame
                elif isinstance(ev, End):
                    for frame in [*self._close(), *self._end(ev)]:
                        yield frame
        finally:
            await source.aclose()

    def _index(self) -> int:
        return len(self.message["content"]) - 1

    def _delta(self, kind: str, text: str) -> list[Frame]:
        """A delta of a text or thinking block, opening it (and closing the other) first."""
        frames = []
        if self.open != kind:
            frames += self._close()
            self.open = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            self.message["content"].append(block)
            frames.append(
                (
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": self._index(),
                        "content_block": dict(block),
                    },
                )
            )
        self.message["content"][-1][kind] += text
        frames.append(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": self._index(),
                    "delta": {"type": f"{kind}_delta", kind: text},
                },
            )
        )
        return frames

    def _close(self) -> list[Frame]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index()})]

    def _call(self, ev: Call) -> list[Frame]:
        block = {
            "type": "tool_use",
            "id": f"toolu_{ev.call.id.removeprefix('call_')}",
            "name": ev.call.name,
            "input": json.loads(ev.call.arguments),
        }
        self.message["content"].append(block)
        i = self._index()
        return [
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": i,
                    "content_block": {**block, "input": {}},
                },
            ),
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": i,
                    "delta": {"type": "input_json_delta", "partial_json": ev.call.arguments},
                },
            ),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]

    def _end(self, end: End) -> list[Frame]:
        calls = any(b["type"] == "tool_use" for b in self.message["content"])
        reason = (
            "max_tokens"
            if end.reason == "length"
            else "tool_use"
            if calls
            else "stop_sequence"
            if end.stop_string is not None
            else "end_turn"
        )
        usage = _usage(end.prompt_tokens, end.cached_tokens, end.output_tokens)
        self.message.update(stop_reason=reason, stop_sequence=end.stop_string, usage=usage)
        return [
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": end.stop_string},
                    "usage": {"output_tokens": end.output_tokens},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]


def _usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens."""
    return {
        "input_tokens": prompt - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output,
    }


def setup(app: web.Application) -> None:
    app.router.add_post(PREFIX, create)
    app.router.add_post(f"{PREFIX}/count_tokens", count_tokens)
