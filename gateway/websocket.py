"""GET /v1/ws: several requests streamed over one WebSocket at once, each keyed by the client's own
id.

Client -> server (JSON text frames):
    {"op": "chat.completions" | "completions", "id": "<client id>",
     "body": {...OpenAI request body...}}
    {"op": "cancel", "id": "<client id>"}
Server -> client:
    {"id": ..., "event": "chunk", "data": {...}}   the very object an SSE `data:` line carries
    {"id": ..., "event": "done"}                   the SSE `data: [DONE]`
    {"id": ..., "event": "cancelled"}              after a cancel: the request is gone from the
                                                   engine
    {"id": ..., "event": "error", "status": 400, "error": {...}}
                                                   OpenAI's error object; id null when the
                                                   message itself could not be read
A malformed message is answered with an error frame and dropped; the socket and the other requests
on it go on. Closing the socket cancels every request still running on it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

import orjson
from aiohttp import web

from gateway.completions import parse_completion
from gateway.openai_output import error_body
from gateway.openai_schema import parse_chat
from gateway.socket_messages import serve_socket
from gateway.state import SERVED
from gateway.streaming import chunks
from shared.errors import ConveyorError, InvalidRequest, Overloaded

log = logging.getLogger(__name__)
OPS = {"chat.completions": True, "completions": False}  # op -> chat?
MAX_ID_LEN = 256


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    return await serve_socket(request, _Session)


class _Session:
    def __init__(self, app: web.Application, ws: web.WebSocketResponse, tenant: str | None) -> None:
        self.app, self.ws = app, ws
        # the socket's API key's (gateway/state.py TENANT), for each request on it
        self.tenant = tenant
        self.live: dict[str, asyncio.Task[None]] = {}  # client id -> the task streaming it
        self.cancelled: set[str] = set()
        self._send_lock = asyncio.Lock()

    async def handle(self, data: str) -> None:
        cid = None
        try:
            msg = orjson.loads(data)
            if not isinstance(msg, dict):
                raise InvalidRequest("a message must be a JSON object")
            cid = msg.get("id")
            unknown = sorted(str(k)[:100] for k in msg if k not in ("op", "id", "body"))
            if not isinstance(cid, str) or not cid or len(cid) > MAX_ID_LEN:
                cid = None
                raise InvalidRequest(f"'id' must be a non-empty string of at most {MAX_ID_LEN} "
                                     "characters", param="id")
            if unknown:  # every field is honoured or refused, here as in the body
                raise InvalidRequest(f"unknown field {unknown[0]!r} in the message: it takes op, "
                                     "id and body", param=unknown[0])
            op = msg.get("op")
            if op == "cancel":
                self.cancel(cid)
            elif op in OPS:
                self.start(cid, OPS[op], msg.get("body"))
            else:
                raise InvalidRequest(f"'op' must be one of {[*OPS, 'cancel']}, got {op!r}",
                                     param="op")
        except orjson.JSONDecodeError as e:
            await self.error(None, InvalidRequest(f"the message is not valid JSON: {e}"))
        except ConveyorError as e:
            await self.error(cid, e)

    def start(self, cid: str, chat: bool, body: Any) -> None:
        if cid in self.live:
            raise InvalidRequest(f"id {cid!r} is already streaming on this socket", param="id")
        if not isinstance(body, dict):
            raise InvalidRequest("'body' must be an OpenAI request object", param="body")
        req = (parse_chat if chat else parse_completion)({**body, "stream": True}, self.app[SERVED])
        req.tenant = self.tenant
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.live[cid] = asyncio.create_task(self._stream(cid, rid, req, chat))

    def cancel(self, cid: str) -> None:
        """Idempotent: a cancel for a request that already ended (or never was) is ignored."""
        task = self.live.get(cid)
        if task is not None and not task.done():
            self.cancelled.add(cid)
            task.cancel()

    async def _stream(self, cid: str, rid: str, req: Any, chat: bool) -> None:
        events = chunks(self.app, req, rid, chat)
        try:
            async for chunk in events:
                await self.send({"id": cid, "event": "chunk", "data": chunk})
            await self.send({"id": cid, "event": "done"})
        except asyncio.CancelledError:
            if cid not in self.cancelled:
                raise  # the socket is closing
            await events.aclose()  # aborts the request in the engine before we say so
            await self._send_quietly({"id": cid, "event": "cancelled"})
        except ConveyorError as e:
            await self._send_quietly(self._error_frame(cid, e))
        except ConnectionError:
            pass  # the socket is gone; close() cancels the rest
        finally:
            await events.aclose()
            self.cancelled.discard(cid)
            if self.live.get(cid) is asyncio.current_task():
                del self.live[cid]

    async def _send_quietly(self, frame: dict[str, Any]) -> None:
        with contextlib.suppress(ConnectionError):
            await self.send(frame)

    @staticmethod
    def _error_frame(cid: str | None, err: ConveyorError) -> dict[str, Any]:
        frame: dict[str, Any] = {"id": cid, "event": "error", "status": err.status,
                                 "error": error_body(err)["error"]}
        if isinstance(err, Overloaded):
            frame["retry_after"] = err.retry_after
        return frame

    async def error(self, cid: str | None, err: ConveyorError) -> None:
        await self.send(self._error_frame(cid, err))

    async def send(self, frame: dict[str, Any]) -> None:
        if self.ws.closed:
            raise ConnectionResetError("websocket closed")
        # one frame at a time; send_str waits while the client reads slowly
        async with self._send_lock:
            await self.ws.send_str(orjson.dumps(frame).decode())

    async def close(self) -> None:
        tasks = list(self.live.values())
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
