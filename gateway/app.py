"""build_app(): the aiohttp application, callable from tests with any AsyncEngineClient.

State lives under typed AppKeys. The engine connection is a cleanup_ctx: the handshake and the
tokenizer load happen before the first request is served, and the client is closed on shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from gateway.admission import Admission, Limits
from gateway.metrics import Metrics
from gateway.openai_schema import Served, error_body
from shared.client import AsyncEngineClient
from shared.errors import ConveyorError, EngineDead, Overloaded
from shared.protocol import RequestOutput

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PUBLIC_PATHS = ("/health", "/ready", "/metrics")  # never behind the API key: probes and scrapers


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None = the name the engine reports in READY
    api_key: str | None = None  # when set, everything but PUBLIC_PATHS needs "Authorization: Bearer <key>"
    limits: Limits = field(default_factory=Limits)
    max_body_size: int = 16 * 2**20  # bytes of a request body before 413
    # Stream the first token at once, then every N tokens: fewer, larger events under load.
    stream_interval: int = 1
    health_timeout: float = 2.0  # /ready answers 503 when the engine is slower than this
    stats_interval: float = 0.5  # how often the engine's queue is polled for admission while requests run

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.max_body_size < 1:
            raise ValueError("max_body_size must be >= 1")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")


CONFIG = web.AppKey("config", GatewayConfig)
CLIENT = web.AppKey("client", AsyncEngineClient)
SERVED = web.AppKey("served", Served)  # filled in at start-up from the engine's READY
ADMISSION = web.AppKey("admission", Admission)
METRICS = web.AppKey("metrics", Metrics)


class Unauthorized(ConveyorError):
    status = 401
    type = "authentication_error"


class PayloadTooLarge(ConveyorError):
    status = 413
    type = "invalid_request_error"


def build_app(config: GatewayConfig, client: AsyncEngineClient) -> web.Application:
    from gateway.routes import routes  # routes import the keys above
    from gateway.websocket import websocket_handler

    app = web.Application(middlewares=[_errors, _auth], client_max_size=config.max_body_size)
    app[CONFIG], app[CLIENT], app[SERVED] = config, client, Served()
    app[ADMISSION], app[METRICS] = Admission(config.limits), Metrics()
    client.on_output = _on_output(app[ADMISSION], app[METRICS])
    app.add_routes(routes)
    app.router.add_get("/v1/ws", websocket_handler)
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
    yield
    await client.close()


async def _background(app: web.Application) -> AsyncIterator[None]:
    """While this gateway has requests in flight, keep the engine's queue length fresh for admission,
    and move locally counted metrics into prometheus (another worker may answer the next scrape)."""
    async def poll() -> None:
        admission, client = app[ADMISSION], app[CLIENT]
        while True:
            await asyncio.sleep(app[CONFIG].stats_interval)
            app[METRICS].flush()
            if admission.in_flight and client.connected:
                with contextlib.suppress(ConveyorError):
                    admission.update_engine(await client.get_stats(timeout=app[CONFIG].health_timeout))

    task = asyncio.create_task(poll())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def error_response(err: ConveyorError) -> web.Response:
    headers = {}
    if isinstance(err, (Overloaded, EngineDead)):
        headers["Retry-After"] = str(getattr(err, "retry_after", 1))
    if isinstance(err, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return web.Response(body=orjson.dumps(error_body(err)), status=err.status, content_type="application/json",
                        headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI error body; one bad request never takes the server down."""
    try:
        return await handler(request)
    except ConveyorError as e:
        if e.status >= 500:
            log.warning("%s %s: %s", request.method, request.path, e)
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ConveyorError(f"{e.reason}: {request.method} {request.path}")
        err.status, err.type = e.status, "invalid_request_error"
        return error_response(err)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ConveyorError("internal error"))


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[CONFIG].api_key
    if key and request.path not in PUBLIC_PATHS:
        given = request.headers.get("Authorization", "")
        if not given and request.path == "/v1/ws":  # browsers cannot set headers on a WebSocket
            given = f"Bearer {request.query.get('api_key', '')}"
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>'")
    return await handler(request)
