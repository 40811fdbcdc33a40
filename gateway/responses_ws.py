"""OpenAI's WebSocket mode of the Responses API: GET /v1/responses upgraded to a WebSocket.

The client sends `{"type": "response.create", ...}` frames whose other fields are a POST
/v1/responses body (`stream` is implied; `background` is refused); the server answers each with the
same events as the SSE stream (responses.py's Render), one JSON text message per event. Several
responses go over one socket: those with the same `stream_id` (OpenAI's "lane"; absent = one default
lane) run one after another in the order sent, and their events echo the `stream_id`; different
lanes run at once. `previous_response_id` finds a response made earlier on this socket even with
`store: false` (the socket keeps its last responses), else in the server's store. A bad frame gets
an `error` event ({"type": "error", "status", "error": {type, code, message, param}}) and the socket
goes on. Closing the socket aborts what is still running on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import orjson
from aiohttp import web

from gateway.openai_output import error_body
from gateway.responses import Render, parse
from gateway.responses_store import ResponseStore
from gateway.socket_messages import serve_socket
from shared.errors import ConveyorError, InvalidRequest

KEPT = 64  # responses each socket keeps for previous_response_id, whatever their `store`


async def websocket(request: web.Request) -> web.WebSocketResponse:
    return await serve_socket(request, _Session, not_a_socket=(
        "GET /v1/responses is the Responses API's WebSocket mode: open a WebSocket and send "
        "response.create messages (POST /v1/responses creates one over HTTP)"))


class _Session:
    def __init__(self, app: web.Application, ws: web.WebSocketResponse, tenant: str | None) -> None:
        self.app, self.ws = app, ws
        # the socket's API key's (gateway/state.py TENANT), for each request on it
        self.tenant = tenant
        self.kept = ResponseStore(KEPT)
        self.last: dict[str | None, asyncio.Task[None]] = {}  # each lane's latest response
        self.tasks: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()

    async def handle(self, data: str) -> None:
        lane = None
        try:
            frame = orjson.loads(data)
            if not isinstance(frame, dict):
                raise InvalidRequest("a message must be a JSON object")
            lane = frame.get("stream_id")
            if lane is not None and (not isinstance(lane, str) or not lane or len(lane) > 256):
                lane = None
                raise InvalidRequest("stream_id must be a non-empty string", param="stream_id")
            if frame.get("type") != "response.create":
                raise InvalidRequest(
                    f"type must be response.create, got {str(frame.get('type'))[:50]!r}",
                    param="type",
                )
            if frame.get("stream") not in (None, True):
                raise InvalidRequest(
                    "stream is implied in WebSocket mode (true or absent)", param="stream"
                )
            body = {k: v for k, v in frame.items() if k not in ("type", "stream", "stream_id")}
            task = asyncio.create_task(self._run(body, lane, self.last.get(lane)))
            self.last[lane] = task  # the lane's next response waits for this one
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        except orjson.JSONDecodeError as e:
            await self.error(None, InvalidRequest(f"the message is not valid JSON: {e}"))
        except ConveyorError as e:
            await self.error(lane, e)

    async def _run(
        self, body: dict[str, Any], lane: str | None, before: asyncio.Task[None] | None
    ) -> None:
        if before is not None:
            await asyncio.wait([before])
        render = None
        try:
            req = parse(self.app, body, self.kept, self.tenant)
            req.stream, req.parsed.tenant = True, self.tenant
            extra = {"stream_id": lane} if lane is not None else None
            render = Render(self.app, req, f"resp_{uuid.uuid4().hex}", extra)
            gen = render.run()
            try:
                async for event in gen:
                    await self.send(event)
            finally:
                await gen.aclose()
            if render.stored is not None:
                self.kept.put(render.rid, render.stored)
        except ConveyorError as e:
            with contextlib.suppress(ConnectionError):
                await self.send(self._error(lane, e, render.seq if render else None))
        except ConnectionError:
            pass  # the socket is gone; close() cancels the rest
        finally:
            if self.last.get(lane) is asyncio.current_task():
                del self.last[lane]

    @staticmethod
    def _error(lane: str | None, err: ConveyorError, seq: int | None) -> dict[str, Any]:
        e = error_body(err)["error"]
        frame: dict[str, Any] = {
            "type": "error",
            "status": err.status,
            "error": {
                "type": e["type"],
                "code": None if e["code"] == err.status else str(e["code"]),
                "message": e["message"],
                "param": e["param"],
            },
        }
        if seq is not None:
            frame["sequence_number"] = seq
        if lane is not None:
            frame["stream_id"] = lane
        return frame

    async def error(self, lane: str | None, err: ConveyorError) -> None:
        with contextlib.suppress(ConnectionError):
            await self.send(self._error(lane, err, None))

    async def send(self, frame: dict[str, Any]) -> None:
        if self.ws.closed:
            raise ConnectionResetError("websocket closed")
        async with self._send_lock:
            await self.ws.send_str(orjson.dumps(frame).decode())

    async def close(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.kept.close()
