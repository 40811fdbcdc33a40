"""The OpenAI objects the gateway answers with: whole responses and stream chunks, their choices,
logprobs in the completions, chat and vLLM prompt_logprobs shapes, usage, and the error body. What
comes in (request bodies -> prompt ids and SamplingParams) is gateway/openai_schema.py's.
"""
from __future__ import annotations

from typing import Any

from shared.choices import TokenLogprob
from shared.errors import ConveyorError


def usage(num_prompt: int, num_output: int, num_cached: int = 0,
          reasoning: int | None = None) -> dict[str, Any]:
    """reasoning: the reasoning tokens (tags included) of a chat request to a reasoning server."""
    u: dict[str, Any] = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
                         "total_tokens": num_prompt + num_output}
    if num_cached:
        u["prompt_tokens_details"] = {"cached_tokens": num_cached}
    if reasoning is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return u


def response_object(rid: str, created: int, model: str, chat: bool, chunk: bool,
                    choices: list[dict[str, Any]],
                    use: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole response (chunk=False, with usage) or one stream chunk (usage only when given)."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    obj: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model,
                           "choices": choices}
    if not chunk or use is not None:
        obj["usage"] = use
    return obj


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same in a whole completion and in a stream chunk."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, finish_reason: str | None, chunk: bool,
                first: bool = False, logprobs: dict[str, Any] | None = None,
                tool_calls: list[dict[str, Any]] | None = None,
                reasoning: str | None = None) -> dict[str, Any]:
    """A whole message, or a stream chunk's delta (the role travels in each choice's first chunk).
    reasoning: None without a reasoning parser; else the message's reasoning_content (null when
    empty), and a delta's when there is some."""
    if not chunk:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}
    delta: dict[str, Any] = ({"role": "assistant", "content": text or ""} if first
                             else {"content": text} if text else {})
    if reasoning:
        delta["reasoning_content"] = reasoning
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _lp(value: float | None) -> float | None:
    """JSON has no -inf (a token a logit_bias or the mask ruled out): report it as vLLM does."""
    return None if value is None else max(value, -9999.0)


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """OpenAI's legacy shape. text_offset: where the first token starts in the choice's
    text so far. top_logprobs holds the k most likely tokens and always the sampled one (so
    up to k + 1, as OpenAI)."""
    tokens, token_logprobs, offsets = [], [], []
    tops: list[dict[str, float | None] | None] = []
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(_lp(e.logprob))
        offsets.append(text_offset)
        text_offset += len(e.token)
        if e.logprob is None:  # an echoed prompt's first token: nothing precedes it
            tops.append(None)
            continue
        top = {s: _lp(v) for _, s, v in e.top}
        if all(t != e.token_id for t, _, _ in e.top):
            top.setdefault(e.token, _lp(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs_view(entries: list[TokenLogprob] | None,
                         k: int) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the token itself and the k most likely tokens at its position (ranks
    1..k)."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": e.token}}
        for r, (t, s, v) in enumerate(e.top[:k], start=1):
            d.setdefault(str(t), {"logprob": _lp(v), "rank": r, "decoded_token": s})
        out.append(d)
    return out


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat shape: per token its string, logprob, UTF-8 bytes and the
    top_logprobs alternatives."""
    return {"content": [{"token": e.token, "logprob": _lp(e.logprob),
                         "bytes": list(e.token.encode()),
                         "top_logprobs": [{"token": s, "logprob": _lp(v), "bytes": list(s.encode())}
                                          for _, s, v in e.top]} for e in entries]}


def error_body(err: ConveyorError) -> dict[str, Any]:
    return {"error": {"message": str(err), "type": err.type, "param": getattr(err, "param", None),
                      "code": getattr(err, "code", None) or err.status}}
