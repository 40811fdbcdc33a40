"""EngineClient: the async client (shared/client.py) made blocking, for scripts and notebooks.

The async client runs on an event loop of its own in a daemon thread; every call is sent to that
loop and waited for. This module imports client.py and never the other way round: import
EngineClient from here.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from shared import protocol as P
from shared.choices import TextOutput
from shared.client import AsyncEngineClient
from shared.sampling import SamplingParams
from shared.tokenizer import Prompt

T = TypeVar("T")


async def _anext(it: AsyncIterator[T]) -> T:
    """The next item as a coroutine, which run_coroutine_threadsafe needs (__anext__ may return
    another awaitable, as an async generator's does)."""
    return await anext(it)


class EngineClient:
    """Blocking wrapper: the async client runs on its own event loop in a daemon thread."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="conveyor-client",
                                        daemon=True)
        self._thread.start()
        self._client = AsyncEngineClient(address, **kwargs)
        self.ready = self._call(self._client.start())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, it: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._call(_anext(it))
                except StopAsyncIteration:
                    return
        finally:
            if hasattr(it, "aclose"):
                self._call(it.aclose())

    def add(self, prompt_token_ids: list[int], params: SamplingParams,
            request_id: str | None = None, priority: int = 0) -> Iterator[P.RequestOutput]:
        return self._iterate(self._call(self._client.add(prompt_token_ids, params, request_id,
                                                         priority)))

    def abort(self, request_id: str) -> None:
        self._call(self._client.abort(request_id))

    def stop_choice(self, request_id: str, index: int) -> None:
        self._call(self._client.stop_choice(request_id, index))

    def reset_prefix_cache(self) -> None:
        self._call(self._client.reset_prefix_cache())

    def get_stats(self, timeout: float = 5.0) -> dict[str, float]:
        return self._call(self._client.get_stats(timeout))

    def stream_text(self, prompt: Prompt, params: SamplingParams,
                    request_id: str | None = None) -> Iterator[TextOutput]:
        return self._iterate(self._client.stream_text(prompt, params, request_id))

    def generate_text(self, prompt: Prompt, params: SamplingParams,
                      request_id: str | None = None) -> TextOutput:
        return self._call(self._client.generate_text(prompt, params, request_id))

    def generate_choices(self, prompt: Prompt, params: SamplingParams,
                         request_id: str | None = None) -> list[TextOutput]:
        return self._call(self._client.generate_choices(prompt, params, request_id))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
