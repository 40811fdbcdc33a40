"""One request's way through the gateway, shared by every door (SSE, JSON, WebSocket), and SSE
itself.

run_request: engine connected? -> admission (429 before anything is queued) -> the engine ->
metrics.
chunks: the OpenAI stream chunks of one request (one choice per chunk), rendered from the one
streaming loop every door shares (gateway/choice_stream.py).
complete: the whole response, every choice (n) in index order.
sse_response: `data: {json}\\n\\n` per chunk, then `data: [DONE]`, over a plain web.StreamResponse.

A client that goes away must not keep the engine busy: a failed write, or the handler being
cancelled (handler_cancellation=True), closes the generators, whose `finally` aborts the request in
the engine. A client that reads slowly gets merged deltas: the SDK's stream keeps one pending output
per request and joins what arrives meanwhile (shared/client.py), so nothing queues up behind a slow
socket.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from aiohttp import web

from gateway.auth import cache_salt
from gateway.choice_stream import ChoiceBuffer, ChoiceStream, Delta
from gateway.openai_output import (
    chat_choice,
    completion_choice,
    error_body,
    prompt_logprobs_view,
    response_object,
    usage,
)
from gateway.openai_schema import ParsedRequest
from gateway.reasoning import split_reasoning
from gateway.state import ADMISSION, CLIENT, CONFIG, METRICS, SERVED
from gateway.tools import stream_deltas
from shared.choices import TextOutput
from shared.errors import ConveyorError, EngineDead, Overloaded
from shared.sampling import SamplingParams

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


async def run_request(app: web.Application, req: ParsedRequest,
                      rid: str) -> AsyncGenerator[TextOutput, None]:
    """TextOutputs of one request. Raises Overloaded (429) or EngineDead (503) before anything is
    queued."""
    client, admission, metrics = app[CLIENT], app[ADMISSION], app[METRICS]
    params = _isolated(app, req)
    if not client.connected:
        raise EngineDead(f"the engine at {client.address} is not connected; the gateway reconnects "
                         "when it is back, retry later")
    try:
        admission.admit(rid, len(req.prompt_token_ids))
    except Overloaded as e:
        metrics.reject(e.reason)
        raise
    metrics.begin(rid)
    reason, last = "abort", None  # stays "abort" when the client goes away before the end
    outputs = client.stream_text(req.prompt_token_ids, params, request_id=rid,
                                 priority=req.priority)
    try:
        async for out in outputs:
            last = out
            if out.finished:
                reason = out.finish_reason or "stop"
            yield out
    except ConveyorError:
        reason = "error"
        raise
    finally:
        await outputs.aclose()  # aborts the request in the engine unless it finished
        admission.release(rid)
        metrics.finish(rid, reason, last.num_prompt_tokens if last else len(req.prompt_token_ids),
                       last.num_cached_tokens if last else 0)
        if req.params.prompt_logprobs is not None and reason not in ("abort", "error"):
            metrics.scored_tokens.inc(len(req.prompt_token_ids))


def _isolated(app: web.Application, req: ParsedRequest) -> SamplingParams:
    """req's params, salted with its API key's tenant under --cache-isolation per-key. Every door
    reaches the engine through here, so a door that forgot the tenant fails loudly instead of
    sharing a cache."""
    if not app[CONFIG].auth.per_key:
        return req.params
    if req.tenant is None:
        raise ConveyorError("internal error: a request reached the engine without its API key's "
                            "tenant")
    return dataclasses.replace(req.params, cache_salt=cache_salt(req.tenant, req.params.cache_salt))


async def chunks(app: web.Application, req: ParsedRequest, rid: str,
                 chat: bool) -> AsyncGenerator[dict[str, Any], None]:
    """OpenAI stream chunks of one request, one choice per chunk (its `index`), rendered from the
    one streaming loop (gateway/choice_stream.py). Nothing is yielded before the engine's first
    output, so an engine ERROR is raised before any byte is sent; the role travels in each choice's
    first chunk."""
    model, created = app[SERVED].name, int(time.time())
    stream = ChoiceStream(req, run_request(app, req, rid), app[CONFIG].stream_interval, chat)
    deltas = stream.deltas()
    try:
        async for d in deltas:
            for choice in _chunk_choices(d, chat):
                yield response_object(rid, created, model, chat, True, [choice])
        if req.include_usage and stream.last is not None:
            yield response_object(rid, created, model, chat, True, [], text_usage(stream.last, req))
    finally:
        await deltas.aclose()


def _chunk_choices(d: Delta, chat: bool) -> list[dict[str, Any]]:
    """One delta as its chunks' choice objects; with tool calls: the content, then each call's
    name and arguments, then the finish reason."""
    text, thought, lps, first, reason = d.text, d.thought, d.logprobs, d.first, d.out.finish_reason
    out = []
    if d.calls:
        head = {"content": text} if text or first else {}
        head |= {"reasoning_content": thought} if thought else {}
        for delta in [head, *stream_deltas(d.calls)]:
            if not delta:
                continue
            if first:
                delta = {"role": "assistant", **delta}
            out.append({"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": None})
            first, lps = False, None
        text, thought, reason = "", "", "tool_calls"
    out.append(chat_choice(d.index, text, reason, True, first, lps, reasoning=thought) if chat
               else completion_choice(d.index, text, reason, lps))
    return out


async def complete(app: web.Application, req: ParsedRequest, rid: str,
                   chat: bool) -> dict[str, Any]:
    """The whole (non-streaming) response object, its choices in index order."""
    created, last, want_lps = int(time.time()), None, req.params.logprobs is not None
    choices: dict[int, ChoiceBuffer] = {}
    outputs = run_request(app, req, rid)
    try:
        async for out in outputs:
            choices.setdefault(out.index, ChoiceBuffer()).add(out, out.text,
                                                              score_only=req.score_only)
            last = out
    finally:
        await outputs.aclose()
    assert last is not None and last.finished  # a stream ends with its finished output, or raises
    body = []
    for index in sorted(choices):
        c = choices[index]
        text, lps = c.take(chat, want_lps, req)
        thought = None
        if chat and req.reasoning is not None:
            thought, text = split_reasoning(text, req.reasoning.opened)
            thought = thought if req.reasoning.include else None
        if chat and req.tools is not None:
            content, calls = req.tools.parse(text)
            reason = "tool_calls" if calls else c.finish_reason
            body.append(chat_choice(index, content, reason, False, logprobs=lps, reasoning=thought,
                                    tool_calls=[call.to_openai() for call in calls]))
            continue
        body.append(chat_choice(index, text, c.finish_reason, chunk=False, logprobs=lps,
                                reasoning=thought) if chat
                    else completion_choice(index, text, c.finish_reason, lps))
        if req.prompt_logprobs is not None and not chat:  # vLLM's: per choice on completions
            body[-1]["prompt_logprobs"] = prompt_logprobs_view(c.prompt, req.prompt_logprobs)
    resp = response_object(rid, created, app[SERVED].name, chat, False, body, text_usage(last, req))
    if req.prompt_logprobs is not None and chat:  # vLLM's: one list for the response on chat
        first = choices[min(choices)].prompt if choices else None
        resp["prompt_logprobs"] = prompt_logprobs_view(first, req.prompt_logprobs)
    return resp


def text_usage(out: TextOutput, req: ParsedRequest) -> dict[str, Any]:
    """Over all choices: the last output's counts are the request's (none generated with max_tokens
    0); reasoning_tokens where a reasoning parser splits the output."""
    return usage(out.num_prompt_tokens, 0 if req.score_only else out.num_output_tokens,
                 out.num_cached_tokens, out.num_reasoning_tokens if req.reasoning is not None
                 else None)


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def sse_response(request: web.Request,
                       events: AsyncGenerator[dict[str, Any], None]) -> web.StreamResponse:
    """Stream `events` as SSE. The first event is awaited before the headers go out, so an
    error the engine answers at once (an ERROR for the ADD, a 429) is still a proper
    status with an OpenAI body."""
    try:
        first = await anext(events, None)
    except BaseException:
        await events.aclose()
        raise
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
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
    with contextlib.suppress(ConnectionResetError):
        await resp.write(data)
