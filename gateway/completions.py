"""OpenAI's legacy /v1/completions beyond one prompt in, one text out: batched prompts, `echo`, and
scoring (`echo` with `logprobs`, `max_tokens: 0`), as evaluation harnesses (lm-eval's
local-completions) send them.

A batch is one engine request per prompt, all validated before any is queued; the response holds one
choice per prompt and per n, `index` = prompt_index * n + choice_index, and the usage of all of
them. `echo` puts the prompt's text before each choice's text (in a stream, in each choice's first
chunk), and with `logprobs` the prompt's tokens before the completion's in `logprobs` (the first
with `null` logprob and `null` top_logprobs), as OpenAI and vLLM do. `max_tokens: 0` (with `echo`
only) scores without generating: the engine samples one token, which the response leaves out, as
vLLM does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from gateway.openai_output import response_object
from gateway.openai_schema import (
    ParsedRequest,
    Served,
    _check_common,
    _finish,
    _show,
    with_prompt_logprobs,
)
from gateway.state import SERVED
from gateway.streaming import chunks, complete
from shared.errors import InvalidRequest
from shared.tokenizer import decode, encode

MAX_BATCH = 1024  # prompts in one request (each is its own engine request; admission counts each)


def parse_completions(body: Any, served: Served) -> list[ParsedRequest]:
    """One ParsedRequest per prompt of the batch; InvalidRequest (naming the prompt's index in a
    batch) before anything is queued."""
    body = _check_common(body, served, chat=False)
    prompts = _prompts(body.get("prompt"))
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidRequest(f"echo must be true or false, got {_show(echo)}", param="echo")
    max_tokens = body.get("max_tokens")
    score_only = type(max_tokens) is int and max_tokens == 0
    if score_only and not echo:
        raise InvalidRequest(
            "max_tokens=0 generates nothing: it scores the prompt with echo=true only",
            param="max_tokens",
        )
    if score_only:
        body = {**body, "max_tokens": 1}
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(_one(body, prompt, served, bool(echo), score_only))
        except InvalidRequest as e:
            if len(prompts) == 1:
                raise
            raise InvalidRequest(f"prompt[{i}]: {e}", param=e.param, code=e.code) from None
    return out


def parse_completion(body: Any, served: Served) -> ParsedRequest:
    """One prompt only (the WebSocket's completions, one request per message)."""
    reqs = parse_completions(body, served)
    if len(reqs) > 1:
        raise InvalidRequest(
            "batched prompts are not supported here: send one prompt per message", param="prompt"
        )
    return reqs[0]


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A string, a token-id list, or a non-empty batch of either."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(
            "prompt must be a string, a list of token ids, or a non-empty list of either",
            param="prompt",
        )
    if len(prompt) > MAX_BATCH:
        raise InvalidRequest(
            f"a batch holds at most {MAX_BATCH} prompts, got {len(prompt)}", param="prompt"
        )
    for i, p in enumerate(prompt):
        if not (isinstance(p, str) or _is_ids(p)):
            raise InvalidRequest(
                f"prompt[{i}] must be a string or a non-empty list of token ids", param="prompt"
            )
    return prompt


def _is_ids(x: Any) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def _one(
    body: dict[str, Any], prompt: str | list[int], served: Served, echo: bool, score_only: bool
) -> ParsedRequest:
    if isinstance(prompt, str):
        served.check_chars(len(prompt), "prompt")
    ids = encode(served.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    req = _finish(body, ids, served, "prompt", default_max_tokens=16, chat=False)
    k = req.params.logprobs if echo else None
    req = with_prompt_logprobs(req, body, echo_k=k)
    if echo:  # token ids echo as their decoded text, as vLLM
        req.echo = prompt if isinstance(prompt, str) else decode(served.tokenizer, ids)
    req.score_only = score_only
    return req


# -- responses
# ------------------------------------------------------------------------------------------


async def complete_batch(
    app: web.Application, reqs: list[ParsedRequest], rid: str
) -> dict[str, Any]:
    """The whole response: every prompt's choices, reindexed, and the usage of all of them."""
    if len(reqs) == 1:
        return await complete(app, reqs[0], rid, chat=False)
    tasks = [
        asyncio.ensure_future(complete(app, r, f"{rid}-{i}", chat=False))
        for i, r in enumerate(reqs)
    ]
    try:
        bodies = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    n = reqs[0].params.n
    choices = []
    for i, body in enumerate(bodies):
        for c in body["choices"]:
            choices.append({**c, "index": i * n + c["index"]})
    return response_object(
        rid,
        bodies[0]["created"],
        app[SERVED].name,
        False,
        False,
        choices,
        sum_usage([b["usage"] for b in bodies]),
    )


async def chunks_batch(
    app: web.Application, reqs: list[ParsedRequest], rid: str
) -> AsyncGenerator[dict[str, Any], None]:
    """Every prompt's stream chunks as they come, reindexed; one usage chunk at the end when
    asked."""
    if len(reqs) == 1:
        one = chunks(app, reqs[0], rid, chat=False)
        try:
            async for chunk in one:
                yield chunk
        finally:
            await one.aclose()
        return
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue(
        maxsize=16
    )
    tasks = [
        asyncio.ensure_future(_pump(app, r, f"{rid}-{i}", i, queue)) for i, r in enumerate(reqs)
    ]
    n, left, usages = reqs[0].params.n, len(reqs), []
    try:
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            item["id"] = rid
            if not item["choices"] and item.get("usage") is not None:
                usages.append(item["usage"])
                continue
            for c in item["choices"]:
                c["index"] += i * n
            yield item
        if usages:
            yield response_object(
                rid, int(time.time()), app[SERVED].name, False, True, [], sum_usage(usages)
            )
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(
    app: web.Application,
    req: ParsedRequest,
    sub_id: str,
    i: int,
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]],
) -> None:
    """One prompt's chunks into the shared queue (bounded: a slow reader slows the producers, and
    the SDK merges what the engine sends meanwhile); its end as None, or its error."""
    gen = chunks(app, req, sub_id, chat=False)
    try:
        async for chunk in gen:
            await queue.put((i, chunk))
    except Exception as e:  # handed to the consumer, which raises it
        await queue.put((i, e))
        return
    finally:
        await gen.aclose()
    await queue.put((i, None))


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {
        k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
    if cached:
        total["prompt_tokens_details"] = {"cached_tokens": cached}
    return total
