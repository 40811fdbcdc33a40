"""Which top-level fields an OpenAI request body may carry: every field is honoured or refused.

Four kinds of field, and nothing else:
- honoured: parsed by openai_schema.py into the prompt, SamplingParams or the request's priority;
- informational: OpenAI defines them as labels for its own bookkeeping (abuse monitoring,
  dashboards, its cache routing) that change no output; they are type-checked and otherwise unused;
- unsupported: OpenAI features this server does not implement (audio, predicted outputs, ...):
  a 400 that names the field and says so, unless the value is null (OpenAI's "not given");
- anything else: a 400 naming the unknown field (a typo such as `max_token` must not pass
  unnoticed).
"""
from __future__ import annotations

from typing import Any

from shared.errors import InvalidRequest

# Honoured by both endpoints (OpenAI's fields, then vLLM's extras).
_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs", "logit_bias",
    "presence_penalty", "frequency_penalty", "stream", "stream_options",
    "top_k", "min_p", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
    "use_beam_search",
    "beam_width", "length_penalty", "early_stopping", "speculative", "priority", "prompt_logprobs",
    "cache_salt",
    # structured output (gateway/structured.py): OpenAI's, then vLLM's current and older spellings
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
})
# Honoured by one endpoint only; the other endpoint's parser answers these with a message that says
# which endpoint takes them (best_of on chat, top_logprobs on completions), so they are known to
# both.
HONOURED = {
    # suffix: neutral values only
    False: _COMMON | {"prompt", "best_of", "echo", "suffix", "top_logprobs"},
    True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "best_of", "tools",
                     "tool_choice",
                     "parallel_tool_calls", "chat_template_kwargs", "include_reasoning",
                     "thinking_token_budget"},
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
    "reasoning_effort": "reasoning effort is not supported (a template's thinking switch goes in "
                        "chat_template_kwargs, e.g. {\"enable_thinking\": false})",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "store": "storing completions is not supported: nothing is stored",
    "service_tier": "service tiers are not supported: there is one tier",
}
# Values of an unsupported field that ask for nothing beyond what the server does anyway.
_NEUTRAL: dict[str, tuple[Any, ...]] = {"store": (False,), "service_tier": ("auto", "default"),
                                        "parallel_tool_calls": (True,)}
STREAM_OPTIONS = {"include_usage": bool}


class Refused:
    """A known nested key this server does not implement: a 400 saying why, unless it is null."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


# The keys every nested object may carry, one table for every route. A shape is a dict (an object:
# its allowed keys -> their shapes), a one-element list (a list whose items have that shape), None
# (a value not walked: a scalar, or free-form such as a JSON schema, `metadata` or `logit_bias`,
# checked by its parser) or Refused. Only the keys are checked here; types and values are the
# parsers' to check (a value of another type than its shape is left to them). Keys follow OpenAI's
# API reference, with what the openai SDK, LangChain, instructor and pydantic-ai send back (an SDK
# message's model_dump carries `refusal`, `annotations`, `audio: null` and `function_call: null`).
Shape = dict[str, Any] | list[Any] | Refused | None
_FUNCTION = {"name": None, "description": None, "parameters": None, "strict": None}
_TOOL_CALL = {"id": None, "type": None, "function": {"name": None, "arguments": None}}
_PART = {"type": None, "text": None,
         "image_url": Refused("image input is not supported: text parts only"),
         "input_audio": Refused("audio input is not supported: text parts only"),
         "file": Refused("file input is not supported: text parts only")}
MESSAGE: Shape = {
    "role": None, "content": [_PART], "name": None, "tool_calls": [_TOOL_CALL],
    "tool_call_id": None, "refusal": None, "annotations": None,
    "reasoning_content": None, "reasoning": None,  # a reasoning model's earlier turn (template)
    "audio": Refused("audio in messages is not supported"),
    "function_call": Refused("the legacy function_call is not supported: use tool_calls"),
}
_JSON_SCHEMA = {"name": None, "schema": None, "strict": None, "description": None}
_NESTED_COMMON: dict[str, Shape] = {
    "response_format": {"type": None, "schema": None, "json_schema": _JSON_SCHEMA},
    "stream_options": {"include_usage": None},
    "structured_outputs": {"json": None, "regex": None, "choice": None, "grammar": None,
                           "json_object": None},
}
TOKENIZE: Shape = {"model": None, "prompt": None, "messages": [MESSAGE],
                   "add_generation_prompt": None, "add_special_tokens": None,
                   "chat_template_kwargs": None}
DETOKENIZE: Shape = {"model": None, "tokens": None}
NESTED: dict[str, dict[str, Shape]] = {
    "/v1/completions": _NESTED_COMMON,
    "/v1/chat/completions": {**_NESTED_COMMON, "messages": [MESSAGE],
                             "tools": [{"type": None, "function": _FUNCTION}],
                             "tool_choice": {"type": None, "function": {"name": None}}},
}


def check_keys(value: Any, shape: Shape, path: str, where: str) -> None:
    """Refuse a key `shape` does not know, at any depth, naming its whole path
    (`messages[1].content[0].foo`)."""
    if isinstance(shape, dict) and isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{str(key)[:100]}" if path else str(key)[:100]
            if key not in shape:
                raise InvalidRequest(f"unknown field {sub!r}: {where} does not take it", param=sub)
            inner = shape[key]
            if isinstance(inner, Refused):
                if item is not None:
                    raise InvalidRequest(f"{sub} is not supported: {inner.why}", param=sub)
            elif inner is not None and item is not None:
                check_keys(item, inner, sub, where)
    elif isinstance(shape, list) and isinstance(value, list):
        for i, item in enumerate(value):
            check_keys(item, shape[0], f"{path}[{i}]", where)


def check_fields(body: dict[str, Any], chat: bool) -> None:
    """Refuse unsupported and unknown fields (naming them); type-check the informational ones."""
    honoured = HONOURED[chat]
    for key, value in body.items():
        if key in honoured:
            continue
        if key in INFORMATIONAL:
            want = INFORMATIONAL[key]
            if value is not None and not isinstance(value, want):
                raise InvalidRequest(f"{key} must be {'a string' if want is str else 'an object'}",
                                     param=key)
        elif key in UNSUPPORTED:
            if value is not None and not any(value is v or (type(value) is type(v) and value == v)
                                             for v in _NEUTRAL.get(key, ())):
                raise InvalidRequest(f"{key} is not supported: {UNSUPPORTED[key]}", param=key)
        else:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            raise InvalidRequest(f"unknown field {str(key)[:100]!r}: {endpoint} does not take it",
                                 param=str(key)[:100])
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    for key, shape in NESTED[endpoint].items():
        if body.get(key) is not None:
            check_keys(body[key], shape, key, endpoint)


def check_stream_options(opts: Any) -> bool:
    """-> include_usage. stream_options must be an object of known, well-typed options."""
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    for key, value in opts.items():  # the keys are known: check_keys ran
        if value is not None and not isinstance(value, STREAM_OPTIONS[key]):
            raise InvalidRequest(f"stream_options.{key} must be true or false",
                                 param=f"stream_options.{key}")
    return bool(opts.get("include_usage"))
