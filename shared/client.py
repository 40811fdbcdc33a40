"""The client SDK: what a program asks of the engine over ZeroMQ; the gateway is one of
its users. No torch here.

AsyncEngineClient is the connection (shared/connection.py: socket, handshake, liveness, resuming
after a lost engine) plus the calls: token level (add, abort, stop_choice, stats, traces) and text
level (the tokenizer and detokenizer of shared/, so the SDK's text equals the gateway's). Blocking:
shared/sync_client.py.
"""
from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, cast

from shared import protocol as P
from shared.choices import Choices, TextOutput, TokenStrings, join_outputs
from shared.connection import EngineConnection
from shared.detokenizer import Decoder, FastDecoder
from shared.embedding import (
    CANNOT_POOL,
    EmbeddingOutput,
    PoolingInfo,
    PoolingParams,
    truncate_tokens,
)
from shared.errors import ConveyorError, InvalidRequest
from shared.requests import LiveRequest
from shared.sampling import SamplingParams, check_priority
from shared.stream import RequestStream
from shared.tokenizer import Prompt, encode_prompt, is_token_ids
from shared.wire import DEFAULT_ENGINE_TIMEOUT


class AsyncEngineClient(EngineConnection):
    """`await client.start()` (or `async with`), then add / abort / stop_choice / get_stats /
    stream_text; `await close()`."""

    def __init__(self, address: str, *, name: str = "client", ready_timeout: float = 10.0,
                 model: str | None = None, tokenizer: Any = None,
                 on_output: Callable[[P.RequestOutput], None] | None = None,
                 resume_timeout: float = 60.0, curve_keys: str | os.PathLike[str] | None = None,
                 engine_timeout: float = DEFAULT_ENGINE_TIMEOUT) -> None:
        """model: where text calls load the tokenizer from (default: the model the engine names in
        READY);
        tokenizer: one already loaded. The rest: EngineConnection's."""
        super().__init__(address, name=name, ready_timeout=ready_timeout, on_output=on_output,
                         resume_timeout=resume_timeout, curve_keys=curve_keys,
                         engine_timeout=engine_timeout)
        self._model, self._tokenizer = model, tokenizer  # model: where to load the tokenizer from
        self._tok_lock = asyncio.Lock()
        self._fast_decoder: Decoder | None = None
        # logprobs' token strings, memoized per client
        self._token_strings: TokenStrings | None = None

    async def __aenter__(self) -> AsyncEngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- a router's calls: requests held for a lost engine move to another client ------------------
    @property
    def has_held(self) -> bool:
        """Requests wait for a lost engine to come back."""
        return bool(self._requests.held)

    def hand_over(self) -> list[LiveRequest]:
        """The requests held for this client's lost engine, removed from it for another to adopt."""
        self._cancel_resume_timer()
        return self._requests.take_held()

    def adopt(self, rec: LiveRequest) -> bool:
        """Continue another client's held request on this client's engine (prompt +
        delivered tokens, as a resume), on the caller's same stream. -> False when this
        client cannot take it now."""
        if not self.connected or rec.request_id in self._requests:
            return False
        again = self._requests.adopt(rec)
        if again is not None:  # None: all tokens delivered, only the final row was lost
            rec.stream.owner = self
            self._spawn(self._send_all([again]))
        return True

    # -- token-level calls -------------------------------------------------------------------------
    async def add(self, prompt_token_ids: list[int], params: SamplingParams,
                  request_id: str | None = None, priority: int = 0,
                  pooling: PoolingParams | None = None) -> RequestStream:
        """Queue a request in the engine; iterate the returned stream for its deltas. An ERROR
        answer from the engine is raised (InvalidRequest) from the iteration. pooling: an embedding
        request (its one output carries the vector; see embed)."""
        check_priority(priority)  # a typed error here, not an ERROR answer later
        await self.wait_ready()
        rid = request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise InvalidRequest(f"request id {rid!r} is already running", param="request_id")
        add = P.Add(rid, list(prompt_token_ids), params, priority, pooling)
        # before the send: an engine lost meanwhile must find it to hold
        stream = self._requests.start(add)
        try:
            await self._send(add)
        except ConveyorError as e:
            self._requests.end(rid, e)
            raise
        return stream

    async def abort(self, request_id: str) -> None:
        """Idempotent. The stream ends at once (finish_reason "abort"); the engine frees the
        request."""
        if not self._requests.end(request_id,
                                  P.RequestOutput(request_id, [], finished=True,
                                                  finish_reason="abort")):
            return
        if self._dead is None and self._sock is not None:
            await self._send(P.Abort([request_id]))

    async def stop_choice(self, request_id: str, index: int) -> None:
        """End one choice of a live n > 1 request (a stop string ended it here): the engine
        frees that sequence and answers with a "stop" row for it; the stream goes on with
        the other choices. A request this client no longer streams is left alone, as the
        engine would ignore it."""
        if request_id in self._requests and self._dead is None:
            await self._send(P.StopChoice(request_id, index))

    async def reset_prefix_cache(self) -> None:
        """Make every cached prefix block unreachable (e.g. after changing what prompts mean);
        blocks in use by running requests stay theirs. The engine does not answer."""
        await self.wait_ready()
        await self._send(P.ResetPrefixCache())

    async def get_stats(self, timeout: float = 5.0) -> dict[str, float]:
        return (await self._ask(P.GetStats(), P.Stats, "GET_STATS", timeout)).gauges

    async def observe(self, seconds: float) -> None:
        """Ask the engine for step rows and queue/KV snapshots (OBSERVED, to on_observed) for
        the next `seconds` (at most 10; renew before it lapses); 0 stops them. The engine
        computes none unasked."""
        await self.wait_ready()
        await self._send(P.Observe(seconds))

    async def start_trace(self) -> None:
        """The engine records a trace of its steps and requests from now on
        (engine/observe/trace.py)."""
        await self.wait_ready()
        await self._send(P.Trace(True))

    async def stop_trace(self, path: str | os.PathLike[str] | None = None,
                         timeout: float = 30.0) -> dict[str, Any]:
        """Stop the engine's trace -> the Chrome trace-event JSON object it recorded, also written
        to path (on this machine) when given. Perfetto and chrome://tracing open the file."""
        trace = (await self._ask(P.Trace(False), P.TraceData, "TRACE", timeout)).trace
        if path is not None:
            import orjson

            await asyncio.to_thread(Path(path).write_bytes, orjson.dumps(trace))
        return trace

    # -- text-level calls --------------------------------------------------------------------------
    async def get_tokenizer(self) -> Any:
        """The tokenizer given to the constructor, else the one of `model`, else of the engine's
        model."""
        async with self._tok_lock:
            if self._tokenizer is None:
                from shared.model_source import resolve_model
                from shared.tokenizer import load_tokenizer

                model = self._model
                if not model:
                    await self.wait_ready()
                    assert self.ready is not None
                    model = self.ready.model_name
                try:
                    source = resolve_model(model)
                except FileNotFoundError as e:
                    raise InvalidRequest(f"text calls need the model's tokenizer, and {e}: give "
                                         "the client model=<the engine's model folder or .gguf> or "
                                         "tokenizer=...") from None
                self._tokenizer = await asyncio.to_thread(load_tokenizer, source)
        return self._tokenizer

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Text calls use this tokenizer (one a router loaded once for all its replicas'
        clients)."""
        self._tokenizer = tokenizer

    async def _decoder(self) -> Decoder:
        if self._fast_decoder is None:
            self._fast_decoder = FastDecoder.wrap(await self.get_tokenizer())
        return self._fast_decoder

    async def encode_prompt(self, prompt: Prompt) -> list[int]:
        if is_token_ids(prompt):
            return list(prompt)  # no tokenizer needed
        return encode_prompt(await self.get_tokenizer(), prompt)

    async def stream_text(self, prompt: Prompt, params: SamplingParams,
                          request_id: str | None = None,
                          priority: int = 0) -> AsyncGenerator[TextOutput, None]:
        """Text deltas of one request, each for one choice (`index`, 0..n-1; see shared/choices.py).
        A stop string ends its choice, in the engine too; when every choice has ended the stream
        ends (the last output has `finished`) and the request is aborted in the engine if it still
        runs. Leaving the loop early or being cancelled (a client that went away) aborts it too."""
        ids = await self.encode_prompt(prompt)
        decoder = await self._decoder()
        if self._token_strings is None:
            self._token_strings = TokenStrings(decoder)
        stream = await self.add(ids, params, request_id, priority)
        choices = Choices(stream.request_id, len(ids), params, decoder, self._token_strings, ids)

        def owner() -> AsyncEngineClient:  # another client, once a router moved the request to it
            return cast(AsyncEngineClient, stream.owner or self)

        try:
            async for out in stream:
                for text_out in choices.feed(out):
                    if text_out.finished and not stream.done:
                        # stop strings ended every choice first
                        await owner().abort(stream.request_id)
                    elif (text_out.finish_reason is not None and out.finish_reason is None
                          and not text_out.finished):
                        # a stop string ended it
                        await owner().stop_choice(stream.request_id, text_out.index)
                    yield text_out
                    if text_out.finished:
                        return
        finally:
            if not stream.done:
                await owner().abort(stream.request_id)

    async def generate_choices(self, prompt: Prompt, params: SamplingParams,
                               request_id: str | None = None) -> list[TextOutput]:
        """Every choice whole, in index order: the text, ids and logprobs of each
        choice's outputs joined."""
        parts: dict[int, list[TextOutput]] = {}
        async for out in self.stream_text(prompt, params, request_id):
            parts.setdefault(out.index, []).append(out)
        return [join_outputs(parts[i], out) for i in sorted(parts)]

    @property
    def pooling(self) -> PoolingInfo:
        """What the engine's pooler does (READY); an engine that announced none cannot pool."""
        info = self.ready.pooling if self.ready is not None else None
        return PoolingInfo.from_dict(info) if info else CANNOT_POOL

    async def embed(self, prompt: Prompt, dimensions: int | None = None,
                    truncate_prompt_tokens: int | None = None, request_id: str | None = None,
                    priority: int = 0) -> EmbeddingOutput:
        """One input's embedding (text or token ids), pooled as the engine does (`pooling`).
        dimensions: a Matryoshka model's shorter vector; truncate_prompt_tokens: keep the last k
        tokens (-1: the context) of an input longer than the context, which is otherwise refused."""
        params = PoolingParams(dimensions)
        await self.wait_ready()
        assert self.ready is not None
        self.pooling.check(params)  # against what the engine announced: a typed error, nothing sent
        ids = truncate_tokens(await self.encode_prompt(prompt), truncate_prompt_tokens,
                              self.ready.max_model_len)
        stream = await self.add(ids, SamplingParams(max_tokens=1), request_id, priority,
                                pooling=params)
        try:  # one prefill-only request; leaving early aborts it in the engine
            async for out in stream:
                if out.finished:
                    if out.embedding is None:
                        raise ConveyorError(f"embedding request {stream.request_id} ended without "
                                            f"a vector ({out.finish_reason})")
                    return EmbeddingOutput(stream.request_id, out.embedding, out.num_prompt_tokens)
            raise ConveyorError(f"embedding request {stream.request_id} ended without an output")
        finally:
            if not stream.done:
                await self.abort(stream.request_id)

    async def generate_text(self, prompt: Prompt, params: SamplingParams,
                            request_id: str | None = None) -> TextOutput:
        """The whole completion of a one-choice request (n == 1; use generate_choices for more)."""
        if params.n != 1:
            raise InvalidRequest(f"generate_text returns one choice and n={params.n}: use "
                                 "generate_choices", param="n")
        return (await self.generate_choices(prompt, params, request_id))[0]
