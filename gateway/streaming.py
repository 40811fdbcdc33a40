"""One request's way through the gateway, shared by every door (SSE, JSON, WebSocket), and SSE
itself.

run_request: engine connected? -> admission (429 before anything is queued) -> the engine ->
metrics.
chunks: the OpenAI stream chunks of one request (one choice per chunk), with --stream-interval
applied.
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
from gateway.openai_output import (
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    error_body,
    prompt_logprobs_view,
    response_object,
    usage,
)
from gateway.openai_schema import ParsedRequest
from gateway.reasoning import ReasoningStream, split_reasoning
from gateway.state import ADMISSION, CLIENT, CONFIG, METRICS, SERVED
from gateway.tools import ToolCall, ToolStream, stream_deltas
from shared.choices import TextOutput, TokenLogprob
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


class _Choice:
    """What one choice has received and not sent yet (--stream-interval), and what a response
    needs."""

    __slots__ = ("text", "reasoning", "logprobs", "num_tokens", "first", "ended", "text_offset",
                 "finish_reason", "prompt", "echoed")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []  # with --reasoning-parser: the reasoning not sent yet
        self.logprobs: list[TokenLogprob] = []
        self.num_tokens = 0  # since the last event
        self.first, self.ended = True, False
        self.text_offset = 0  # completions' text_offset of the next token
        self.finish_reason: str | None = None
        # prompt logprobs, from the choice's first output
        self.prompt: list[TokenLogprob] | None = None
        self.echoed = False

    def add(self, out: TextOutput, reasoning: str = "", score_only: bool = False) -> None:
        if out.prompt_logprobs is not None and self.prompt is None:
            self.prompt = out.prompt_logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        if score_only:  # max_tokens 0: the one token the engine sampled is not part of the answer
            return
        self.text.append(out.text)
        if reasoning:
            self.reasoning.append(reasoning)
        self.num_tokens += len(out.token_ids)
        if out.logprobs:
            self.logprobs += out.logprobs

    def take_reasoning(self) -> str:
        text, self.reasoning = "".join(self.reasoning), []
        return text

    def take(self, chat: bool, want_logprobs: bool, req: ParsedRequest | None = None,
             ) -> tuple[str, dict[str, Any] | None]:
        """-> the text and logprobs object gathered since the last take; with completions' echo the
        prompt's text (and its tokens' logprobs) go first, in the first take."""
        text, entries = "".join(self.text), self.logprobs
        self.text, self.logprobs, self.num_tokens = [], [], 0
        if req is not None and req.echo is not None and not self.echoed:
            self.echoed = True
            text = req.echo + text
            k = req.params.logprobs or 0
            entries = [dataclasses.replace(e, top=e.top[:k]) for e in self.prompt or []] + entries
        if not want_logprobs:
            return text, None
        if chat:
            return text, chat_logprobs(entries)
        lps = completion_logprobs(entries, self.text_offset)
        self.text_offset += sum(len(e.token) for e in entries)
        return text, lps


class ChoiceSplit:
    """One streamed chat choice's text -> (reasoning, content, tool calls at the end): the
    reasoning parser first (--reasoning-parser), then the tool-call parser on the content. The
    one per-choice split every front door renders from (chat chunks here; Responses, Messages)."""

    __slots__ = ("reasoning", "tools", "include")

    def __init__(self, req: ParsedRequest) -> None:
        opened = req.reasoning.opened if req.reasoning is not None else None
        self.reasoning = ReasoningStream(opened) if opened is not None else None
        self.include = req.reasoning is not None and req.reasoning.include
        self.tools = ToolStream(req.tools) if req.tools is not None else None

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        thought, calls = "", list[ToolCall]()
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if final:
                more, rest = self.reasoning.finish()
                thought, text = thought + more, text + rest
        if self.tools is not None:
            text = self.tools.feed(text)
            if final:
                rest, calls = self.tools.finish()
                text += rest
        return (thought if self.include else ""), text, calls


async def chunks(app: web.Application, req: ParsedRequest, rid: str,
                 chat: bool) -> AsyncGenerator[dict[str, Any], None]:
    """OpenAI stream chunks of one request, one choice per chunk (its `index`). Nothing is
    yielded before the engine's first output, so an engine ERROR is raised before any byte is
    sent; the role travels in each choice's first chunk. With stream_interval N a choice's first
    token goes out at once, then an event every N of its tokens (and its last). Logprobs travel
    with the text they belong to."""
    model, interval = app[SERVED].name, app[CONFIG].stream_interval
    created, last, want_lps = int(time.time()), None, req.params.logprobs is not None
    choices: dict[int, _Choice] = {}
    splits: dict[int, ChoiceSplit] = {}
    outputs = run_request(app, req, rid)
    try:
        async for out in outputs:
            last = out
            c = choices.get(out.index) or choices.setdefault(out.index, _Choice())
            if c.ended:
                continue
            calls: list[ToolCall] = []
            thought = ""
            if chat and (req.tools is not None or req.reasoning is not None):  # may hold back tags
                split = splits.get(out.index) or splits.setdefault(out.index, ChoiceSplit(req))
                thought, text, calls = split.feed(out.text, out.finish_reason is not None)
                out = dataclasses.replace(out, text=text)
            c.add(out, thought, req.score_only)
            c.ended = out.finish_reason is not None
            if not (c.first or c.ended or c.num_tokens >= interval):
                continue
            if not (any(c.text) or c.reasoning or c.logprobs or c.ended or c.first):
                continue  # text held back (an unfinished character, a possible stop string)
            text, lps = c.take(chat, want_lps, req)
            thought, reason = c.take_reasoning(), out.finish_reason
            if calls:  # the content, then each call's name and arguments, then the finish reason
                head = {"content": text} if text or c.first else {}
                head |= {"reasoning_content": thought} if thought else {}
                for delta in [head, *stream_deltas(calls)]:
                    if not delta:
                        continue
                    if c.first:
                        delta = {"role": "assistant", **delta}
                    choice = {"index": out.index, "delta": delta, "logprobs": lps,
                              "finish_reason": None}
                    c.first, lps = False, None
                    yield response_object(rid, created, model, chat, True, [choice])
                text, thought, reason = "", "", "tool_calls"
            choice = (chat_choice(out.index, text, reason, True, c.first, lps, reasoning=thought)
                      if chat else completion_choice(out.index, text, reason, lps))
            c.first = False
            yield response_object(rid, created, model, chat, True, [choice])
        if req.include_usage and last is not None:
            yield response_object(rid, created, model, chat, True, [], text_usage(last, req))
    finally:
        await outputs.aclose()


async def complete(app: web.Application, req: ParsedRequest, rid: str,
                   chat: bool) -> dict[str, Any]:
    """The whole (non-streaming) response object, its choices in index order."""
    created, last, want_lps = int(time.time()), None, req.params.logprobs is not None
    choices: dict[int, _Choice] = {}
    outputs = run_request(app, req, rid)
    try:
        async for out in outputs:
            choices.setdefault(out.index, _Choice()).add(out, score_only=req.score_only)
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
