"""build_app(): the aiohttp application, callable from tests with any AsyncEngineClient.

State lives under the typed AppKeys of gateway/state.py. The engine connection is a cleanup_ctx: the
handshake and the tokenizer load happen before the first request is served, and the client is closed
on shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web

from gateway import anthropic, dashboard, responses, responses_ws
from gateway.admission import Admission
from gateway.metrics import Metrics
from gateway.openai_output import error_body
from gateway.openai_schema import Served
from gateway.reasoning import CLOSE, spellings
from gateway.router import Router
from gateway.routes import routes
from gateway.state import (
    ADMISSION,
    CLIENT,
    CONFIG,
    METRICS,
    PUBLIC_PATHS,
    SERVED,
    TENANT,
    GatewayConfig,
    Unauthorized,
)
from gateway.websocket import websocket_handler
from shared.client import AsyncEngineClient
from shared.errors import ConveyorError, EngineDead, Overloaded
from shared.protocol import RequestOutput

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(config: GatewayConfig, client: AsyncEngineClient | Router) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth], client_max_size=config.max_body_size)
    app[CONFIG], app[CLIENT], app[SERVED] = config, client, Served()
    app[ADMISSION], app[METRICS] = Admission(config.limits), Metrics()
    client.on_output = _on_output(app[ADMISSION], app[METRICS])
    app.add_routes(routes)
    app.router.add_get("/v1/ws", websocket_handler)
    responses.setup(app, config.responses_store_size, config.responses_store_path)
    app.router.add_get("/v1/responses", responses_ws.websocket)  # OpenAI's WebSocket mode
    anthropic.setup(app)
    dashboard.setup(app)
    app.cleanup_ctx.append(_engine)
    app.cleanup_ctx.append(_background)
    return app


def _on_output(admission: Admission, metrics: Metrics) -> Callable[[RequestOutput], None]:
    def on_output(out: RequestOutput) -> None:
        if out.new_token_ids or out.finished:
            admission.started(out.request_id)
        metrics.on_output(out)
    return on_output


async def _engine(app: web.Application) -> AsyncIterator[None]:
    client, served = app[CLIENT], app[SERVED]
    ready = await client.start()
    served.name = app[CONFIG].served_model_name or ready.model_name
    served.max_model_len = ready.max_model_len
    served.tokenizer = await client.get_tokenizer()
    longest = max((len(t) for t in served.tokenizer.get_vocab()), default=1)
    served.max_prompt_chars = app[CONFIG].max_prompt_chars or ready.max_model_len * max(longest, 1)
    served.chat_template = app[CONFIG].chat_template
    served.tool_call_parser = app[CONFIG].tool_call_parser
    served.reasoning_parser = app[CONFIG].reasoning_parser
    if served.reasoning_parser is not None:
        served.reasoning_end_spellings = spellings(served.tokenizer, CLOSE)
    yield
    await client.close()


async def _background(app: web.Application) -> AsyncIterator[None]:
    """While this gateway has requests in flight, keep the engine's queue length fresh
    for admission, and move locally counted metrics into prometheus (another worker may
    answer the next scrape)."""
    async def poll() -> None:
        admission, client = app[ADMISSION], app[CLIENT]
        while True:
            await asyncio.sleep(app[CONFIG].stats_interval)
            app[METRICS].flush()
            if admission.in_flight and client.connected:
                with contextlib.suppress(ConveyorError):
                    stats = await client.get_stats(timeout=app[CONFIG].health_timeout)
                    admission.update_engine(stats)

    task = asyncio.create_task(poll())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def error_response(err: ConveyorError, path: str = "") -> web.Response:
    """OpenAI's error body; Anthropic's on the Messages API's routes."""
    headers = {}
    if isinstance(err, Overloaded):
        headers["Retry-After"] = str(err.retry_after)
    elif isinstance(err, EngineDead):
        headers["Retry-After"] = "1"  # the gateway reconnects by itself once the engine is back
    if isinstance(err, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    if path.startswith(anthropic.PREFIX):
        body = anthropic.anthropic_error_body(err)
    else:
        body = error_body(err)
    return web.Response(body=orjson.dumps(body), status=err.status, content_type="application/json",
                        headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI error body; one bad request never takes the server down."""
    try:
        return await handler(request)
    except ConveyorError as e:
        if e.status >= 500:
            log.warning("%s %s: %s", request.method, request.path, e)
        return error_response(e, request.path)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ConveyorError(f"{e.reason}: {request.method} {request.path}")
        err.status, err.type = e.status, "invalid_request_error"
        return error_response(err, request.path)
    except asyncio.CancelledError:
        raise
    # the client left mid-request (its body cut short): nobody to answer
    except ConnectionResetError:
        log.info("%s %s: the client went away", request.method, request.path)
        return web.Response(status=499)  # nginx's "client closed request", for the access log
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ConveyorError("internal error"), request.path)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    auth = request.app[CONFIG].auth
    if auth.keys and request.path not in PUBLIC_PATHS:
        key = auth.match(_given_key(request))
        if key is None:
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>' (or "
                               "x-api-key)")
        if auth.per_key:
            request[TENANT] = key.tenant
    return await handler(request)


def _given_key(request: web.Request) -> str:
    """The key from "Authorization: Bearer", else x-api-key (Anthropic's clients send it so), else
    ?api_key= where a browser cannot set headers (WebSockets, the dashboard)."""
    if request.headers.get("Authorization"):
        scheme, _, token = request.headers["Authorization"].partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""
    if "x-api-key" in request.headers:
        return request.headers["x-api-key"]
    if request.path == "/v1/ws" or request.path in dashboard.PATHS:
        return request.query.get("api_key", "")
    return ""
