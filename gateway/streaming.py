"""Server-sent events over a plain web.StreamResponse: `data: {json}\\n\\n` per chunk, then `data: [DONE]`.

A client that goes away must not keep the engine busy: a failed write, or the handler being cancelled
(handler_cancellation=True), closes the event generator, whose `finally` aborts the request.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from aiohttp import web

from gateway.openai_schema import error_body
from shared.errors import ConveyorError

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def sse_response(request: web.Request, events: AsyncGenerator[dict[str, Any], None]) -> web.StreamResponse:
    """Stream `events` as SSE. The first event is awaited before the headers go out, so an error the
    engine answers at once (an ERROR for the ADD) is still a proper 4xx with an OpenAI error body."""
    try:
        first = await anext(events, None)
    except BaseException:
        await events.aclose()
        raise
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    try:
        await resp.prepare(request)
        if first is not None:
            await resp.write(sse_event(first))
        async for event in events:
            await resp.write(sse_event(event))
        await resp.write(DONE)
    except ConnectionResetError:  # the client went away; `finally` aborts the request in the engine
        log.info("client disconnected from %s", request.path)
    except ConveyorError as e:  # too late for a status code: the error travels as the last event
        await _write_quietly(resp, sse_event(error_body(e)) + DONE)
    finally:
        await events.aclose()
    return resp


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionResetError:
        pass
