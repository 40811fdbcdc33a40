"""What the gateway's two WebSocket endpoints share (GET /v1/ws, gateway/websocket.py; OpenAI's
WebSocket mode of the Responses API, gateway/responses_ws.py): the socket's message loop. Each text
message goes to its session. A message over the server's body limit, or a binary one, is answered
with an error and the socket goes on. Closing the socket closes the session."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from aiohttp import WSMsgType, web

from gateway.state import CONFIG, TENANT, PayloadTooLarge
from shared.errors import ConveyorError, InvalidRequest


class Session(Protocol):
    async def handle(self, data: str) -> None: ...

    async def error(self, key: str | None, err: ConveyorError) -> None: ...

    async def close(self) -> None: ...


SessionFactory = Callable[[web.Application, web.WebSocketResponse, str | None], Session]


async def serve_socket(request: web.Request, session_for: SessionFactory,
                       not_a_socket: str | None = None) -> web.WebSocketResponse:
    """Upgrades request and runs its messages through session_for(app, ws, tenant) until the socket
    closes. not_a_socket: the error a plain HTTP request gets (else aiohttp's own refusal)."""
    limit = request.app[CONFIG].max_body_size
    # aiohttp closes the socket on a frame over max_msg_size; up to twice the limit we answer
    # instead.
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=2 * limit + 65536)
    if not_a_socket is not None and not ws.can_prepare(request).ok:
        raise InvalidRequest(not_a_socket)
    await ws.prepare(request)
    session = session_for(request.app, ws, request.get(TENANT))
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT and len(msg.data) > limit:
                await session.error(None,
                                    PayloadTooLarge("the message is larger than this server's "
                                                    f"limit of {limit} bytes"))
            elif msg.type == WSMsgType.TEXT:
                await session.handle(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await session.error(None,
                                    InvalidRequest("binary frames are not accepted: send JSON text "
                                                   "frames"))
    finally:
        await session.close()
    return ws
