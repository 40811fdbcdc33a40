"""One request's outputs as the SDK hands them to its caller: an async iterator fed by the client's
single reader task (shared/client.py), which merges what a slow consumer has not read yet."""
from __future__ import annotations

import asyncio

from shared import protocol as P
from shared.errors import ConveyorError


class RequestStream:
    """Async iterator over one request's RequestOutput deltas; ends after the finished one.

    Holds at most one pending output per sequence: deltas that arrive while the consumer is busy (a
    client that reads slowly) are merged into it, so a slow reader gets fewer, larger deltas instead
    of an ever-growing queue. A merged delta moves behind the others, so the request's finished one
    stays last.
    """

    __slots__ = ("request_id", "done", "owner", "_pending", "_error", "_waiter")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.done = False
        # The client that took this request over from the one that started it (a data-parallel
        # replica whose engine was lost, gateway/router.py): its aborts go there. None: the one that
        # started it.
        self.owner: object | None = None
        self._pending: list[P.RequestOutput] = []
        self._error: ConveyorError | None = None
        # The consumer's wake-up, while it waits: a bare future costs less than an asyncio.Event,
        # and this runs once per request per engine step.
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: P.RequestOutput | ConveyorError) -> None:
        if isinstance(item, ConveyorError):
            self._error = self._error or item
        else:
            for i, old in enumerate(self._pending):  # usually empty: the consumer keeps up
                if old.index == item.index:
                    del self._pending[i]
                    item = merge_outputs(old, item)
                    break
            self._pending.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> P.RequestOutput:
        if self.done:
            raise StopAsyncIteration
        while not self._pending and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._pending:  # outputs that arrived before an error are still delivered
            out = self._pending.pop(0)
            self.done = out.finished
            return out
        self.done = True
        assert self._error is not None  # the wait above ends on an output or an error
        raise self._error


def merge_outputs(old: P.RequestOutput, new: P.RequestOutput) -> P.RequestOutput:
    """Two consecutive deltas of one sequence as one, in place in `old` (a stream's own
    pending copy): tokens (and logprobs) joined, the fields that change from delta to delta
    taken from the newer one."""
    old.new_token_ids += new.new_token_ids
    old.finished, old.finish_reason = new.finished, new.finish_reason
    old.num_cached_tokens = new.num_cached_tokens
    if new.events is not None:
        old.events = new.events
    if new.embedding is not None:
        old.embedding = new.embedding
    if new.logprobs is not None:
        old.logprobs = new.logprobs if old.logprobs is None else old.logprobs + new.logprobs
    if new.prompt_logprobs is not None:  # the request's first row carries them, once
        old.prompt_logprobs = new.prompt_logprobs
    return old
