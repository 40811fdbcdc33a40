"""Several completions over one WebSocket, one of them cancelled midway (see docs/api.md).

    conveyor serve --port 8000 &
    python examples/websocket_client.py --url ws://127.0.0.1:8000/v1/ws
"""
from __future__ import annotations

import argparse
import asyncio

import aiohttp


async def main(url: str, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    texts: dict[str, str] = {"a": "", "b": "", "c": ""}
    async with aiohttp.ClientSession() as session, session.ws_connect(url, headers=headers) as ws:
        chat = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 32}
        await ws.send_json({"op": "chat.completions", "id": "a", "body": chat})
        await ws.send_json({"op": "completions", "id": "b",
                            "body": {"prompt": "A very long story:", "max_tokens": 500}})
        await ws.send_json({"op": "completions", "id": "c",
                            "body": {"prompt": "1, 2, 3,", "max_tokens": 16}})
        open_ids = set(texts)
        while open_ids:
            frame = await ws.receive_json()
            rid, event = frame["id"], frame["event"]
            if event == "chunk":
                choice = frame["data"]["choices"][0] if frame["data"]["choices"] else {}
                texts[rid] += choice.get("text") or choice.get("delta", {}).get("content") or ""
                if rid == "b" and len(texts["b"]) > 40:
                    await ws.send_json({"op": "cancel", "id": "b"})  # enough of that one
            elif event in ("done", "cancelled"):
                print(f"[{rid}] {event}: {texts[rid]!r}")
                open_ids.discard(rid)
            elif event == "error":
                print(f"[{rid}] error {frame['status']}: {frame['error']['message']}")
                open_ids.discard(rid)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/ws")
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    asyncio.run(main(args.url, args.api_key))
