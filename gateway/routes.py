"""HTTP handlers. They only translate HTTP to shared/client.py calls and back; all
checking of bodies is in openai_schema.py, the request lifecycle in streaming.py, and all
engine I/O in the client."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from aiohttp import web

from gateway import embeddings as embeddings_api
from gateway.completions import chunks_batch, complete_batch, parse_completions
from gateway.engine_metrics import ReplicaRow
from gateway.metrics import CONTENT_TYPE
from gateway.openai_schema import Served, parse_chat, parse_messages
from gateway.request_fields import DETOKENIZE, TOKENIZE, Shape, check_keys
from gateway.router import Router
from gateway.state import CLIENT, CONFIG, METRICS, SERVED, TENANT, PayloadTooLarge, RequestTimeout
from gateway.streaming import chunks, complete, sse_response
from gateway.templates import template_for, template_kwargs
from shared.errors import ConveyorError, EngineDead, InvalidRequest
from shared.tokenizer import apply_chat_template, decode, encode

log = logging.getLogger(__name__)
routes = web.RouteTableDef()
T = TypeVar("T")
# Tokenizing (and rendering chat templates) happens here, off the event loop: a prompt of megabytes
# takes seconds, and every stream of this gateway would stall meanwhile. One thread: a fast
# tokenizer must not be entered from several threads at once; --max-prompt-chars bounds what waits
# behind it.
_TOKENIZER = ThreadPoolExecutor(1, thread_name_prefix="tokenize")


async def tokenizing(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER,
                                                            functools.partial(fn, *args, **kwargs))


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def read_json(request: web.Request) -> Any:
    timeout = request.app[CONFIG].body_timeout
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        log.warning("%s %s: the body did not arrive within %gs (--body-timeout); closing",
                    request.method, request.path, timeout)
        raise RequestTimeout(f"the request body did not arrive within {timeout:g}s") from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"the request body is larger than this server's limit of "
                              f"{request.app[CONFIG].max_body_size} bytes") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    """One prompt or a batch (gateway/completions.py: batches, echo, scoring)."""
    app = request.app
    reqs = await tokenizing(parse_completions, await read_json(request), app[SERVED])
    for r in reqs:
        r.tenant = request.get(TENANT)
    rid = f"cmpl-{uuid.uuid4().hex}"
    if reqs[0].stream:
        return await sse_response(request, chunks_batch(app, reqs, rid))
    return json_response(await complete_batch(app, reqs, rid))


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    req = await tokenizing(parse_chat, await read_json(request), app[SERVED])
    req.tenant = request.get(TENANT)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if req.stream:
        return await sse_response(request, chunks(app, req, rid, chat))
    return json_response(await complete(app, req, rid, chat))


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    return json_response(await embeddings_api.create(request.app, await read_json(request)))


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    return json_response({"object": "list",
                          "data": [{"id": served.name, "object": "model", "created": 0,
                                    "owned_by": "conveyor",
                                    "max_model_len": served.max_model_len}]})


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """Liveness: this process serves HTTP. It does not ask the engine (see /ready): a gateway
    waiting for its engine to come back is alive and must not be restarted for it."""
    return json_response({"status": "ok", "engine_connected": request.app[CLIENT].connected})


@routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    """Readiness: the engine handshake is done and it answers GET_STATS in time; else 503."""
    client = request.app[CLIENT]
    if not client.connected:
        raise EngineDead(f"the engine at {client.address} is not connected")
    stats = await client.get_stats(timeout=request.app[CONFIG].health_timeout)
    return json_response({"status": "ready", "model": request.app[SERVED].name,
                          "num_running": stats.get("num_running"),
                          "num_waiting": stats.get("num_waiting")})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    client, stats = request.app[CLIENT], None
    if client.connected:
        # on an error: exported as conveyor_engine_up 0; the gateway's own metrics are still
        # worth a scrape
        with contextlib.suppress(ConveyorError):
            stats = await client.get_stats(timeout=request.app[CONFIG].health_timeout)
    replicas = None
    # data parallelism: each replica's gauges too, labelled by address
    if isinstance(client, Router):
        rows = await client.replica_stats(timeout=request.app[CONFIG].health_timeout)
        replicas = [ReplicaRow(r.address, st, r.num_routed) for r, st in zip(client.replicas, rows)]
    body = request.app[METRICS].render(stats, replicas)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    body, served = await read_json(request), request.app[SERVED]
    _check_body(body, TOKENIZE, "/tokenize", served)
    if "messages" in body:
        messages = parse_messages(body["messages"])
        served.check_chars(sum(len(m["content"]) for m in messages), "messages")
        template = template_for(served.tokenizer, served.chat_template,
                                any(m["role"] == "tool" or m.get("tool_calls") for m in messages))
        kwargs = template_kwargs(body.get("chat_template_kwargs"), served.tokenizer, template)
        ids = await tokenizing(apply_chat_template, served.tokenizer, messages, template=template,
                               kwargs=kwargs,
                               add_generation_prompt=bool(body.get("add_generation_prompt", True)))
    elif isinstance(body.get("prompt"), str):
        served.check_chars(len(body["prompt"]), "prompt")
        ids = await tokenizing(encode, served.tokenizer, body["prompt"],
                               add_special_tokens=bool(body.get("add_special_tokens", True)))
    else:
        raise InvalidRequest("give either 'prompt' (a string) or 'messages'", param="prompt")
    return json_response({"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    body, served = await read_json(request), request.app[SERVED]
    _check_body(body, DETOKENIZE, "/detokenize", served)
    ids = body.get("tokens")
    vocab = len(served.tokenizer)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
    return json_response({"prompt": decode(served.tokenizer, ids)})


def _check_body(body: Any, shape: Shape, where: str, served: Served) -> None:
    """A tokenizer route's body: an object of known keys at every depth, for the served model."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_keys(body, shape, "", where)
    if body.get("model") is not None and body["model"] != served.name:
        raise InvalidRequest(f"The model `{str(body['model'])[:100]}` does not exist. This server "
                             f"serves `{served.name}`.", param="model", code="model_not_found")
