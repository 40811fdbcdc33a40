"""One request's output as API-neutral events, which each API renders in its own shape.

Chat completions, OpenAI's Responses API and Anthropic's Messages API are three front doors to one
request and one stream. Each door's parser translates its body into a chat-completions body and
builds the one internal request with openai_schema.parse_chat (template, tools, grammar,
SamplingParams); every door streams through run_request (admission, the engine, metrics), the one
detokenizer (shared/choices.py) and the one streaming loop (gateway/choice_stream.py: per choice,
the reasoning parser, then the tool-call parser, and --stream-interval), which the chat and
completions routes render as chunks; the Responses and Messages doors get these events:

    Started(prompt tokens)       the engine's first output arrived (nothing comes before it, so an
                                 error the engine answers at once is still an HTTP status)
    Thought(text)                reasoning (--reasoning-parser only), all of it before any Text
    Text(text)                   content, as it may go out (--stream-interval applied)
    Call(ToolCall)               a whole tool call, after the content, once the output ended
    End(reason, ...)             "stop" | "length", the stop string that hit, usage (reasoning
                                 tokens included)

The Responses and Messages doors ask for one choice (neither API has `n`).
sse() writes named SSE events (`event: NAME` / `data: JSON`), the framing both those APIs use.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from gateway.choice_stream import ChoiceStream
from gateway.openai_schema import ParsedRequest
from gateway.state import CONFIG
from gateway.streaming import run_request
from gateway.tools import ToolCall
from shared.errors import ConveyorError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Thought:
    text: str


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    call: ToolCall


@dataclass(frozen=True, slots=True)
class End:
    # "stop" (EOS, stop token, stop string, grammar end) | "length"; Calls may precede either
    reason: str
    stop_string: str | None  # the stop string that ended the output, if one did
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0  # of output_tokens, those in the reasoning part (--reasoning-parser)


Event = Started | Thought | Text | Call | End


async def events(app: web.Application, req: ParsedRequest, rid: str) -> AsyncGenerator[Event, None]:
    """The events of a one-choice request, from the one streaming loop every door shares
    (gateway/choice_stream.py); closing the generator aborts it in the engine."""
    stream = ChoiceStream(req, run_request(app, req, rid), app[CONFIG].stream_interval, chat=True)
    deltas = stream.deltas()
    try:
        async for d in deltas:
            out = d.out
            if d.first:
                yield Started(out.num_prompt_tokens, out.num_cached_tokens)
            if d.thought:  # a delta's reasoning precedes its content
                yield Thought(d.thought)
            if d.text:
                yield Text(d.text)
            if out.finish_reason is not None or out.finished:
                for call in d.calls:
                    yield Call(call)
                yield End(out.finish_reason or "stop", out.stop_string, out.num_prompt_tokens,
                          out.num_output_tokens, out.num_cached_tokens, out.num_reasoning_tokens)
                return
    finally:
        await deltas.aclose()


Frame = tuple[str, dict[str, Any]]  # (SSE event name, JSON data)


async def sse(
    request: web.Request,
    frames: AsyncGenerator[Frame, None],
    on_error: Callable[[ConveyorError], Frame],
) -> web.StreamResponse:
    """Stream named SSE events. The first frame is awaited before the headers go out, so an error
    before the engine's first output is a proper status with the API's error body; a later one is
    rendered by on_error as the stream's last event."""
    try:
        first = await anext(frames, None)
    except BaseException:
        await frames.aclose()
        raise
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    try:
        await resp.prepare(request)
        if first is not None:
            await resp.write(_frame(first))
        async for frame in frames:
            await resp.write(_frame(frame))
    except ConnectionResetError:  # the client went away; closing `frames` aborts the request
        log.info("client disconnected from %s", request.path)
    except ConveyorError as e:  # too late for a status code
        with contextlib.suppress(ConnectionResetError):
            await resp.write(_frame(on_error(e)))
    finally:
        await frames.aclose()
    return resp


def _frame(frame: Frame) -> bytes:
    return b"event: " + frame[0].encode() + b"\ndata: " + orjson.dumps(frame[1]) + b"\n\n"
