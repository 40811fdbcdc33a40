"""OpenAI request bodies -> (prompt ids, SamplingParams), and the response/chunk objects back.

Everything a client can get wrong is checked here, before the engine sees the request, and answered
with a 400 in OpenAI's error shape; the engine re-checks only what protects itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import ConveyorError, InvalidRequest
from shared.sampling import SamplingParams
from shared.tokenizer import apply_chat_template, encode

# OpenAI / vLLM field -> SamplingParams field, passed through as given (SamplingParams validates).
_PASSTHROUGH = {name: name for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
                                        "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                        "logit_bias", "speculative")}
# Accepted only at their neutral value until the gateway implements them: never silently ignored.
_NEUTRAL = {"n": 1, "best_of": 1, "logprobs": False, "top_logprobs": 0, "echo": False, "suffix": None,
            "use_beam_search": False}
_UNSUPPORTED = {
    "n": "this server returns exactly one choice per request (parallel sampling needs engine support); "
         "send n requests with different seeds instead",
    "best_of": "this server samples exactly one sequence per request",
    "logprobs": "this server does not return log probabilities yet",
    "top_logprobs": "this server does not return log probabilities yet",
    "use_beam_search": "this server samples exactly one sequence per request",
}


@dataclass(slots=True)
class Served:
    """What the gateway serves, learned from the engine's READY at start-up."""

    name: str = ""
    max_model_len: int = 0
    tokenizer: Any = None


@dataclass(slots=True)
class ParsedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def parse_completion(body: Any, served: Served) -> ParsedRequest:
    body = _check_common(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = encode(served.tokenizer, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest("batched prompts are not supported: send one prompt per request", param="prompt")
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids", param="prompt")
    return _finish(body, ids, served, "prompt", default_max_tokens=16)


def parse_chat(body: Any, served: Served) -> ParsedRequest:
    body = _check_common(body, served)
    ids = apply_chat_template(served.tokenizer, parse_messages(body.get("messages")))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        body = {**body, "max_tokens": max_tokens}
    return _finish(body, ids, served, "messages", default_max_tokens=max(1, served.max_model_len - len(ids)))


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages; content given as a list of text parts is joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content") or ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({**m, "content": content})
    return out


def _check_common(body: Any, served: Served) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served.name:
        raise InvalidRequest(f"The model `{model}` does not exist. This server serves `{served.name}`.",
                             param="model", code="model_not_found")
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        # logprobs=0 asks for the sampled token's logprob (completions): only null / false mean "none".
        if value not in (None, neutral) or (key == "logprobs" and value is not None and value is not False):
            why = _UNSUPPORTED.get(key, "the engine does not implement it")
            raise InvalidRequest(f"{key}={value!r} is not supported yet: {why}", param=key)
    return body


def _finish(body: dict[str, Any], ids: list[int], served: Served, what: str, default_max_tokens: int) -> ParsedRequest:
    vocab = len(served.tokenizer)
    if not ids:
        raise InvalidRequest(f"the {what} is empty after tokenization", param=what)
    if any(t < 0 or t >= vocab for t in ids):
        raise InvalidRequest(f"token ids must be in [0, {vocab})", param=what)
    fields = {dst: body[src] for src, dst in _PASSTHROUGH.items() if body.get(src) is not None}
    if fields.get("top_k") == -1:
        fields["top_k"] = 0  # vLLM's spelling of "off"
    max_tokens = body.get("max_tokens")
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    params = SamplingParams.from_dict({**fields, "max_tokens": max_tokens, "stop": stop})
    if len(ids) + max_tokens > served.max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {served.max_model_len} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the {what}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion.", param=what, code="context_length_exceeded")
    opts = body.get("stream_options") or {}
    stream = body.get("stream", False)
    if not isinstance(stream, bool) or not isinstance(opts, dict):
        raise InvalidRequest("stream must be a boolean and stream_options an object", param="stream")
    return ParsedRequest(ids, params, stream, bool(opts.get("include_usage")))


# -- responses ------------------------------------------------------------------------------------------


def usage(num_prompt: int, num_output: int, num_cached: int = 0) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}
    if num_cached:
        u["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return u


def completion_object(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                      chunk: bool, use: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole completion (chunk=False, with usage) or one stream chunk of it: the same shape."""
    obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if not chunk or use is not None:
        obj["usage"] = use
    return obj


def chat_object(rid: str, created: int, model: str, text: str | None, finish_reason: str | None, chunk: bool,
                use: dict[str, Any] | None = None, first: bool = False) -> dict[str, Any]:
    if chunk:
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [choice]}
        if use is not None:
            obj["usage"] = use
        return obj
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": use}


def error_body(err: ConveyorError) -> dict[str, Any]:
    return {"error": {"message": str(err), "type": err.type, "param": getattr(err, "param", None),
                      "code": getattr(err, "code", None) or err.status}}
