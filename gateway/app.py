"""build_app(): the aiohttp application, callable from tests with any AsyncEngineClient.

State lives under typed AppKeys. The engine connection is a cleanup_ctx: the handshake and the
tokenizer load happen before the first request is served, and the client is closed on shutdown.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from gateway.openai_schema import Served, error_body
from shared.client import AsyncEngineClient
from shared.errors import ConveyorError

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None = the name the engine reports in READY
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    # Requests in flight in this gateway before new ones get 429: a bound, never an unbounded queue.
    max_pending: int = 1024
    health_timeout: float = 2.0  # /health answers 503 when the engine is slower than this

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")


@dataclass
class Counters:
    inflight: int = 0
    total: int = 0


CONFIG = web.AppKey("config", GatewayConfig)
CLIENT = web.AppKey("client", AsyncEngineClient)
SERVED = web.AppKey("served", Served)  # filled in at start-up from the engine's READY
COUNTERS = web.AppKey("counters", Counters)


class Unauthorized(ConveyorError):
    status = 401
    type = "authentication_error"


def build_app(config: GatewayConfig, client: AsyncEngineClient) -> web.Application:
    from gateway.routes import routes  # routes import the keys above

    app = web.Application(middlewares=[_errors, _auth], client_max_size=16 * 2**20)
    app[CONFIG], app[CLIENT], app[SERVED], app[COUNTERS] = config, client, Served(), Counters()
    app.add_routes(routes)
    app.cleanup_ctx.append(_engine)
    return app


async def _engine(app: web.Application) -> AsyncIterator[None]:
    client, served = app[CLIENT], app[SERVED]
    ready = await client.start()
    served.name = app[CONFIG].served_model_name or ready.model_name
    served.max_model_len = ready.max_model_len
    served.tokenizer = await client.get_tokenizer()
    yield
    await client.close()


def _error_response(err: ConveyorError) -> web.Response:
    return web.Response(body=orjson.dumps(error_body(err)), status=err.status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI error body; one bad request never takes the server down."""
    try:
        return await handler(request)
    except ConveyorError as e:
        if e.status >= 500:
            log.warning("%s %s: %s", request.method, request.path, e)
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ConveyorError(f"{e.reason}: {request.method} {request.path}")
        err.status, err.type = e.status, "invalid_request_error"
        return _error_response(err)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(ConveyorError("internal error"))


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[CONFIG].api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise Unauthorized("missing or wrong API key")
    return await handler(request)
