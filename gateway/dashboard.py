"""GET /dashboard: a live page of the engine's queues, KV blocks, steps and latencies; GET
/dashboard/ws: the WebSocket that feeds it.

The data path: while at least one viewer is connected, this gateway keeps an OBSERVE subscription
with the engine alive (renewed every RENEW_EVERY seconds for SUBSCRIPTION seconds, so a gateway that
dies stops the engine's work soon after); the engine sends OBSERVED messages (step rows, snapshots,
latency samples: engine/observe/dashboard.py) and each is encoded once and fanned out to every
viewer. A viewer that reads slowly loses its oldest messages (a bounded queue each), never the
others' or the gateway's memory. With no viewer, nothing is asked of the engine and it computes
nothing for the dashboard.

The page is gateway/static/dashboard.{html,css,js}, served as one document (CSS and script inlined):
no build step, nothing fetched from elsewhere. It is behind the API key like the rest; a browser
cannot set the Authorization header, so the page and its socket also take the key as ?api_key= (the
page passes on the one it was opened with).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from gateway.router import Router
from gateway.state import CLIENT, SERVED
from shared.client import AsyncEngineClient
from shared.errors import ConveyorError
from shared.protocol import Observed

log = logging.getLogger(__name__)
SUBSCRIPTION = 3.0  # seconds each OBSERVE asks for
RENEW_EVERY = 1.0
VIEWER_QUEUE = 64  # messages a viewer may be behind before its oldest are dropped
# may carry the API key as ?api_key= (a browser sets no headers)
PATHS = ("/dashboard", "/dashboard/ws")


class Hub:
    """The viewers of one gateway process, and the engine subscription kept while there are any."""

    def __init__(self, client: AsyncEngineClient) -> None:
        self.client = client
        self.viewers: set[asyncio.Queue[bytes]] = set()
        # closed on shutdown: an open one would hold it up
        self.sockets: set[web.WebSocketResponse] = set()
        self._renewer: asyncio.Task[None] | None = None
        self.sent = 0  # messages fanned out (each counted once, whatever the number of viewers)

    def join(self) -> asyncio.Queue[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue(VIEWER_QUEUE)
        self.viewers.add(queue)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew())
        return queue

    def leave(self, queue: asyncio.Queue[bytes]) -> None:
        self.viewers.discard(queue)

    def on_observed(self, msg: Observed) -> None:
        if not self.viewers:
            return
        data = orjson.dumps({"steps": msg.steps, "snapshot": msg.snapshot, "ttft": msg.ttft,
                             "itl": msg.itl})
        self.sent += 1
        for queue in self.viewers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(data)

    async def _renew(self) -> None:
        """Keep the engine's OBSERVE alive while anyone views; end it when the last viewer
        leaves.

        A viewer that joins while the stop is being sent finds this task not done, so join()
        starts no other: the task looks at the viewers again after the stop and goes on for
        them. Only the check and the return, with no await between them, end it."""
        try:
            while True:
                while self.viewers:
                    await self._observe(SUBSCRIPTION)
                    await asyncio.sleep(RENEW_EVERY)
                await self._observe(0)
                if not self.viewers:
                    return
        finally:
            self._renewer = None

    async def _observe(self, seconds: float) -> None:
        """One OBSERVE, if the engine is there; a failed one is retried at the next renewal, so
        nothing it raises may end the task while viewers wait."""
        if not self.client.connected:
            return
        try:
            await self.client.observe(seconds)
        except ConveyorError:
            pass
        except Exception:  # a dead renewer would leave every viewer without data
            log.exception("OBSERVE(%g) failed; retrying at the next renewal", seconds)

    async def close(self) -> None:
        self.viewers.clear()
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer


HUBS = web.AppKey("dashboard_hubs", list[Hub])


def setup(app: web.Application) -> None:
    """Routes, one hub per engine (each data-parallel replica's own: the page shows one
    replica, the one its ?replica=N names, and says which), and each client's OBSERVED
    callback, for build_app()."""
    client = app[CLIENT]
    watched = [r.client for r in client.replicas] if isinstance(client, Router) else [client]
    hubs = [Hub(c) for c in watched]
    app[HUBS] = hubs
    for c, hub in zip(watched, hubs):
        c.on_observed = hub.on_observed
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/ws", viewer)

    async def closing(app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.gather(*(hub.close() for hub in app[HUBS]))

    async def close_sockets(app: web.Application) -> None:
        for ws in [ws for hub in app[HUBS] for ws in hub.sockets]:
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")

    app.on_shutdown.append(close_sockets)
    app.cleanup_ctx.append(closing)


def _page_bytes() -> bytes:
    static = resources.files("gateway") / "static"
    html = (static / "dashboard.html").read_text(encoding="utf-8")
    css = (static / "dashboard.css").read_text(encoding="utf-8")
    js = (static / "dashboard.js").read_text(encoding="utf-8")
    return html.replace("/*STYLE*/", css).replace("/*SCRIPT*/", js).encode()


_PAGE: bytes | None = None


async def page(request: web.Request) -> web.Response:
    _replica(request)
    global _PAGE
    if _PAGE is None:
        _PAGE = _page_bytes()
    return web.Response(body=_PAGE, content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store",
                                 "Content-Security-Policy": "default-src 'none'; style-src "
                                                            "'unsafe-inline'; script-src "
                                                            "'unsafe-inline'; connect-src 'self'; "
                                                            "img-src 'self' data:"})


def _replica(request: web.Request) -> int:
    """?replica=N (default 0): which engine's hub; 400 naming the range otherwise."""
    n = len(request.app[HUBS])
    text = request.query.get("replica", "0")
    if not (text.isdigit() and int(text) < n):
        raise web.HTTPBadRequest(text=f"replica must be an integer in [0, {n - 1}]")
    return int(text)


async def viewer(request: web.Request) -> web.WebSocketResponse:
    index = _replica(request)
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=4096)
    await ws.prepare(request)
    hubs = request.app[HUBS]
    hub = hubs[index]
    served = request.app[SERVED]
    replica = {"index": index, "addresses": [h.client.address for h in hubs]}
    hello = {"model": served.name, "max_model_len": served.max_model_len, "replica": replica}
    await ws.send_str(orjson.dumps({"hello": hello}).decode())
    queue = hub.join()
    hub.sockets.add(ws)

    async def pump() -> None:
        while True:
            await ws.send_str((await queue.get()).decode())

    sender = asyncio.create_task(pump())
    try:
        async for msg in ws:  # viewers send nothing; reading notices the close
            if msg.type == WSMsgType.ERROR:
                break
    finally:
        hub.leave(queue)
        hub.sockets.discard(ws)
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionResetError):
            await sender
    return ws
