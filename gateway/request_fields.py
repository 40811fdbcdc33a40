"""Which top-level fields an OpenAI request body may carry: every field is honoured or refused.

Four kinds of field, and nothing else:
- honoured: parsed by openai_schema.py into the prompt, SamplingParams or the request's priority;
- informational: OpenAI defines them as labels for its own bookkeeping (abuse monitoring, dashboards,
  its cache routing) that change no output; they are type-checked and otherwise unused;
- unsupported: OpenAI features this server does not implement (audio, predicted outputs, ...):
  a 400 that names the field and says so, unless the value is null (OpenAI's "not given");
- anything else: a 400 naming the unknown field (a typo such as `max_token` must not pass unnoticed).
"""
from __future__ import annotations

from typing import Any

from shared.errors import InvalidRequest

# Honoured by both endpoints (OpenAI's fields, then vLLM's extras).
_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs", "logit_bias",
    "presence_penalty", "frequency_penalty", "stream", "stream_options",
    "top_k", "min_p", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty", "use_beam_search",
    "beam_width", "length_penalty", "early_stopping", "speculative", "priority", "cache_salt",
    # structured output (gateway/structured.py): OpenAI's, then vLLM's current and older spellings
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})
# Honoured by one endpoint only; the other endpoint's parser answers these with a message that says
# which endpoint takes them (best_of on chat, top_logprobs on completions), so they are known to both.
HONOURED = {
    False: _COMMON | {"prompt", "best_of", "echo", "suffix", "top_logprobs"},  # echo/suffix: neutral values only
    True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "best_of", "tools", "tool_choice",
                     "parallel_tool_calls"},
}
# name -> the JSON type it must have. Accepted and unused: they describe the caller, not the output.
INFORMATIONAL: dict[str, type] = {"user": str, "metadata": dict, "safety_identifier": str,
                                  "prompt_cache_key": str}
# OpenAI's chat/completions and completions fields this server does not implement.
UNSUPPORTED: dict[str, str] = {
    # honoured by chat (HONOURED[True]); completions have no messages to carry calls
    "tools": "tool calling is a chat feature: use /v1/chat/completions",
    "tool_choice": "tool calling is a chat feature: use /v1/chat/completions",
    "parallel_tool_calls": "tool calling is a chat feature: use /v1/chat/completions",
    "functions": "the legacy functions field is not supported: use tools",
    "function_call": "the legacy function_call field is not supported: use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "output modalities are not supported: the output is text",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is not supported: the model is not a reasoning model",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "store": "storing completions is not supported: nothing is stored",
    "service_tier": "service tiers are not supported: there is one tier",
}
# Values of an unsupported field that ask for nothing beyond what the server does anyway.
_NEUTRAL: dict[str, tuple[Any, ...]] = {"store": (False,), "service_tier": ("auto", "default"),
                                        "parallel_tool_calls": (True,)}
STREAM_OPTIONS = {"include_usage": bool}


def check_fields(body: dict[str, Any], chat: bool) -> None:
    """Refuse unsupported and unknown fields (naming them); type-check the informational ones."""
    honoured = HONOURED[chat]
    for key, value in body.items():
        if key in honoured:
            continue
        if key in INFORMATIONAL:
            want = INFORMATIONAL[key]
            if value is not None and not isinstance(value, want):
                raise InvalidRequest(f"{key} must be {'a string' if want is str else 'an object'}", param=key)
        elif key in UNSUPPORTED:
            if value is not None and not any(value is v or (type(value) is type(v) and value == v)
                                             for v in _NEUTRAL.get(key, ())):
                raise InvalidRequest(f"{key} is not supported: {UNSUPPORTED[key]}", param=key)
        else:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            raise InvalidRequest(f"unknown field {str(key)[:100]!r}: {endpoint} does not take it", param=str(key)[:100])


def check_stream_options(opts: Any) -> bool:
    """-> include_usage. stream_options must be an object of known, well-typed options."""
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    for key, value in opts.items():
        if key not in STREAM_OPTIONS:
            raise InvalidRequest(f"stream_options.{str(key)[:100]} is not supported (only include_usage)",
                                 param="stream_options")
        if value is not None and not isinstance(value, STREAM_OPTIONS[key]):
            raise InvalidRequest(f"stream_options.{key} must be true or false", param="stream_options")
    return bool(opts.get("include_usage"))
