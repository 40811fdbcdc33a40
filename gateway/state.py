"""What every gateway module shares: the config, the typed AppKeys of the application's state, and
the gateway's own errors.

It lives apart from app.py so that the handlers (routes, streaming, websocket) and build_app() can
all import it at module top: app.py imports the handlers, the handlers import this, nothing imports
app.py back. Each AppKey's value has one writer, build_app() (SERVED: the engine cleanup_ctx at
start-up).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from gateway.admission import Admission, Limits
from gateway.auth import Auth
from gateway.metrics import Metrics
from gateway.openai_schema import Served
from gateway.reasoning import PARSERS as REASONING_PARSERS
from gateway.router import Router
from gateway.tools import PARSERS
from shared.client import AsyncEngineClient
from shared.errors import ConveyorError

PUBLIC_PATHS = ("/health", "/ready", "/metrics")  # never behind the API key: probes and scrapers


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None = the name the engine reports in READY
    # with keys, everything but PUBLIC_PATHS needs one of them
    auth: Auth = field(default_factory=Auth)
    limits: Limits = field(default_factory=Limits)
    max_body_size: int = 16 * 2**20  # bytes of a request body before 413
    # Stream the first token at once, then every N tokens: fewer, larger events under load.
    stream_interval: int = 1
    health_timeout: float = 2.0  # /ready answers 503 when the engine is slower than this
    # how often the engine's queue is polled for admission while requests run
    stats_interval: float = 0.5
    # --chat-template FILE's text: every chat request is rendered with it
    chat_template: str | None = None
    tool_call_parser: str = "auto"  # how tool calls are read from the output (gateway/tools.py)
    reasoning_parser: str | None = None  # splits <think> reasoning off (gateway/reasoning.py)
    responses_store_size: int = 1024  # stored /v1/responses kept for previous_response_id (LRU)
    # The SQLite file the gateway workers of one serve share (gateway/topology.py); None: in memory.
    responses_store_path: str | None = None
    # Characters of prompt text before 400, checked before tokenizing; None: max_model_len times the
    # longest token's characters (more text than that cannot fit the context, whatever it says).
    max_prompt_chars: int | None = None
    # Stalled connections (gateway/connections.py): seconds to send a request's headers, and its
    # body; open connections past max_connections are closed at once.
    header_timeout: float = 15.0
    body_timeout: float = 60.0
    max_connections: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.max_body_size < 1:
            raise ValueError("max_body_size must be >= 1")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if self.responses_store_size < 0:
            raise ValueError("responses_store_size must be >= 0")
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {PARSERS}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}")


CONFIG = web.AppKey("config", GatewayConfig)
# One engine's client, or a Router over several replicas' (gateway/router.py): the same calls.
CLIENT: web.AppKey[AsyncEngineClient | Router] = web.AppKey("client")
SERVED = web.AppKey("served", Served)  # filled in at start-up from the engine's READY
ADMISSION = web.AppKey("admission", Admission)
METRICS = web.AppKey("metrics", Metrics)
# Under --cache-isolation per-key: the tenant salt of the key a request came with (gateway/auth.py),
# set by the auth middleware; every door copies it into its ParsedRequest.tenant.
TENANT = web.RequestKey("tenant", str)


class Unauthorized(ConveyorError):
    status = 401
    type = "authentication_error"


class PayloadTooLarge(ConveyorError):
    """A body (HTTP) or a message (WebSocket) over --max-body-size: answered, never read whole."""

    status = 413
    type = "invalid_request_error"


class RequestTimeout(ConveyorError):
    """A body that did not arrive within --body-timeout: a client that stalls holds nothing for
    long."""

    status = 408
    type = "invalid_request_error"
