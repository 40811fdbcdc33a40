"""HTTP handlers. They only translate HTTP to shared/client.py calls and back; all checking of bodies
is in openai_schema.py and all engine I/O in the client."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from aiohttp import web

from gateway.app import CLIENT, CONFIG, COUNTERS, SERVED
from gateway.openai_schema import (ParsedRequest, chat_object, completion_object, parse_chat, parse_completion,
                                   parse_messages, usage)
from gateway.streaming import sse_response
from shared.client import AsyncEngineClient, TextOutput
from shared.errors import InvalidRequest, Overloaded
from shared.tokenizer import apply_chat_template, decode, encode

routes = web.RouteTableDef()


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def _read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    app, served = request.app, request.app[SERVED]
    req = (parse_chat if chat else parse_completion)(await _read_json(request), served)
    counters = app[COUNTERS]
    if counters.inflight >= app[CONFIG].max_pending:
        raise Overloaded(f"{counters.inflight} requests are in flight, the limit of this gateway; retry later")
    counters.inflight += 1
    counters.total += 1
    try:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return await sse_response(request, _events(app[CLIENT], req, rid, served.name, chat))
        return _json_response(await _complete(app[CLIENT], req, rid, served.name, chat))
    finally:
        counters.inflight -= 1


async def _events(client: AsyncEngineClient, req: ParsedRequest, rid: str, model: str,
                  chat: bool) -> AsyncGenerator[dict[str, Any], None]:
    """OpenAI stream chunks of one request. Nothing is yielded before the engine's first output, so an
    engine ERROR is raised before any byte is sent; the role travels in that first chunk."""
    created, first, last = int(time.time()), True, None
    outputs = client.stream_text(req.prompt_token_ids, req.params, request_id=rid)
    try:
        async for out in outputs:
            last = out
            if not (out.text or out.finished or first):
                continue  # text held back (an unfinished character, a possible stop string)
            reason = out.finish_reason if out.finished else None
            if chat:
                yield chat_object(rid, created, model, out.text, reason, chunk=True, first=first)
            else:
                yield completion_object(rid, created, model, out.text, reason, chunk=True)
            first = False
        if req.include_usage and last is not None:
            yield {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                   "model": model, "choices": [], "usage": _usage(last)}
    finally:
        await outputs.aclose()  # aborts the request in the engine unless it finished


async def _complete(client: AsyncEngineClient, req: ParsedRequest, rid: str, model: str, chat: bool) -> dict[str, Any]:
    created, parts, last = int(time.time()), [], None
    outputs = client.stream_text(req.prompt_token_ids, req.params, request_id=rid)
    try:
        async for out in outputs:
            parts.append(out.text)
            last = out
    finally:
        await outputs.aclose()
    assert last is not None and last.finished  # a stream ends with its finished output, or raises
    make = chat_object if chat else completion_object
    return make(rid, created, model, "".join(parts), last.finish_reason, chunk=False, use=_usage(last))


def _usage(out: TextOutput) -> dict[str, Any]:
    return usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    return _json_response({"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                                       "owned_by": "conveyor", "max_model_len": served.max_model_len}]})


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """200 only when the engine answers GET_STATS in time (EngineDead -> 503 via the error middleware)."""
    await request.app[CLIENT].get_stats(timeout=request.app[CONFIG].health_timeout)
    return _json_response({"status": "ok"})


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    body, served = await _read_json(request), request.app[SERVED]
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if "messages" in body:
        ids = apply_chat_template(served.tokenizer, parse_messages(body["messages"]),
                                  add_generation_prompt=bool(body.get("add_generation_prompt", True)))
    elif isinstance(body.get("prompt"), str):
        ids = encode(served.tokenizer, body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
    else:
        raise InvalidRequest("give either 'prompt' (a string) or 'messages'", param="prompt")
    return _json_response({"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    body, served = await _read_json(request), request.app[SERVED]
    ids = body.get("tokens") if isinstance(body, dict) else None
    vocab = len(served.tokenizer)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
    return _json_response({"prompt": decode(served.tokenizer, ids)})
