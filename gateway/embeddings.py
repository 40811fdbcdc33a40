"""POST /v1/embeddings in OpenAI's shape, served by the same engine as generation.

Every input of a request is checked and tokenized before any is queued (a 400 names the field); the
inputs then run as one prefill-only engine request each (engine/pooling.py), concurrently, and the
response lists their vectors in input order. For admission and metrics the HTTP request is one
request whose prompt is all of its inputs' tokens."""

from __future__ import annotations

import asyncio
import base64
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from gateway.openai_schema import Served
from gateway.state import ADMISSION, CLIENT, METRICS, SERVED
from shared.embedding import EmbeddingOutput, PoolingParams, truncate_tokens
from shared.errors import ConveyorError, EngineDead, InvalidRequest, Overloaded
from shared.sampling import MAX_TOKEN_ID
from shared.tokenizer import encode

FIELDS = frozenset(
    {"input", "model", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"}
)
MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
ENCODINGS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    inputs: list[list[int]]  # token ids per input, truncated as asked
    params: PoolingParams
    encoding_format: str


def parse(body: Any, served: Served) -> EmbeddingsRequest:
    """The body -> every input's token ids; InvalidRequest (400) naming the field otherwise."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidRequest(
            f"unknown field {unknown[0]!r}: /v1/embeddings takes {', '.join(sorted(FIELDS))}",
            param=unknown[0],
        )
    model = body.get("model")
    if model is not None and model != served.name:
        raise InvalidRequest(
            f"The model `{model}` does not exist. This server serves `{served.name}`.",
            param="model",
            code="model_not_found",
        )
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ENCODINGS:
        raise InvalidRequest(
            f"encoding_format must be 'float' or 'base64', not {fmt!r}", param="encoding_format"
        )
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidRequest("user must be a string", param="user")
    params = PoolingParams(body.get("dimensions"))
    truncate = body.get("truncate_prompt_tokens")
    ids = [
        truncate_tokens(x, truncate, served.max_model_len)
        for x in _inputs(body.get("input"), served)
    ]
    return EmbeddingsRequest(ids, params, fmt)


def _inputs(value: Any, served: Served) -> list[list[int]]:
    """input: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str) or _is_ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "input must be a non-empty string, list of strings, list of token ids, or list of "
            "token id lists",
            param="input",
        )
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(
            f"input has {len(value)} items; at most {MAX_INPUTS} per request", param="input"
        )
    out = []
    for i, x in enumerate(value):
        if isinstance(x, str):
            if not x:
                raise InvalidRequest(f"input[{i}] is an empty string", param="input")
            out.append(encode(served.tokenizer, x))
        elif _is_ids(x):
            out.append(list(x))
        else:
            raise InvalidRequest(
                f"input[{i}] must be a non-empty string or a non-empty list of token ids "
                f"(integers in [0, {MAX_TOKEN_ID}])",
                param="input",
            )
    return out


def _is_ids(x: Any) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in x)
    )


async def create(app: web.Application, body: Any) -> dict[str, Any]:
    """The route's answer to a body: parse, admit once, run every input, answer in OpenAI's shape.
    """
    served, client = app[SERVED], app[CLIENT]
    req = parse(body, served)
    if not client.connected:
        raise EngineDead(
            f"the engine at {client.address} is not connected; the gateway reconnects when it is "
            "back, retry later"
        )
    client.pooling.check(
        req.params
    )  # this server cannot pool, or not to these dimensions: before anything
    rid = f"embd-{uuid.uuid4().hex}"
    outs = await _run(app, rid, req)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(o.embedding, req.encoding_format)}
        for i, o in enumerate(outs)
    ]
    tokens = sum(o.num_prompt_tokens for o in outs)
    return {
        "object": "list",
        "data": data,
        "model": served.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def _run(app: web.Application, rid: str, req: EmbeddingsRequest) -> list[EmbeddingOutput]:
    """Every input as its own engine request, at once; the first failure aborts the others."""
    client, admission, metrics = app[CLIENT], app[ADMISSION], app[METRICS]
    num_tokens = sum(map(len, req.inputs))
    try:
        admission.admit(rid, num_tokens)
    except Overloaded as e:
        metrics.reject(e.reason)
        raise
    metrics.begin(rid)
    reason = "abort"  # stays so when the client goes away first
    tasks = [
        asyncio.ensure_future(client.embed(ids, req.params.dimensions, request_id=f"{rid}-{i}"))
        for i, ids in enumerate(req.inputs)
    ]
    try:
        outs = list(await asyncio.gather(*tasks))
        reason = "stop"
        metrics.embedded(len(outs), num_tokens)
        return outs
    except ConveyorError:
        reason = "error"
        raise
    finally:
        for t in tasks:
            t.cancel()  # each aborts its engine request unless it finished
        await asyncio.gather(*tasks, return_exceptions=True)
        admission.release(rid)
        metrics.finish(rid, reason, num_tokens, 0)


def _encoded(v: list[float], fmt: str) -> list[float] | str:
    """base64: the float32 little-endian bytes, as OpenAI sends them (its SDK decodes them with
    numpy)."""
    if fmt == "float":
        return v
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
