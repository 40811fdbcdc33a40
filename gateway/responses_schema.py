"""A Responses API body (POST /v1/responses, or a WebSocket `response.create`) -> the one internal
request.

The body is translated into a chat-completions body and built by openai_schema.parse_chat, so the
template, the tools' grammar, text.format's grammar and SamplingParams are the chat route's own:

    input (string, or message / function_call / function_call_output / reasoning items)
                                     -> messages (gateway/responses_input.py)
    instructions                     -> a leading system message (previous_response_id drops it)
    previous_response_id             -> the stored conversation, before this input
    tools [{type: function, ...}]    -> tools [{type: function, function: {...}}]
    tool_choice                      -> tool_choice (none / auto / required / named)
    text.format                      -> response_format (text / json_object / json_schema)
    max_output_tokens                -> max_tokens
    reasoning.effort "none"          -> chat_template_kwargs {"enable_thinking": false}
                                        (--reasoning-parser only; other efforts are a 400)
Every key at every depth is known or refused with a 400 naming its path (gateway/fields.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.fields import known, metadata, obj_at, typed
from gateway.openai_schema import ParsedRequest, Served, parse_chat
from gateway.responses_input import input_items, input_messages
from shared.errors import InvalidRequest

TOP = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "metadata",
        "user",
        "store",
        "stream",
        "previous_response_id",
        "include",
        "truncation",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "background",
        "service_tier",
        "stream_options",
        "top_logprobs",
        "reasoning",
        "max_tool_calls",
    }
)
# Known Responses fields this server does not implement: a 400 naming them (unless null).
REFUSED = {
    "conversation": "conversations are not supported: use previous_response_id",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "context_management": "context management (compaction) is not supported",
    "moderation": "moderation is not supported",
    "prompt_cache_options": "prompt cache options are not supported (the prefix cache needs none)",
    "stream_id": "stream_id is a WebSocket-mode field",
}
# field -> the values that ask for nothing beyond what the server does anyway
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "truncation": ("disabled",),
    "background": (False,),
    "service_tier": ("auto", "default"),
    "top_logprobs": (0,),
    "include": ([],),
    "reasoning": ({},),
    "stream_options": ({}, {"include_obfuscation": False}),
}
WHY = {
    "truncation": "truncation 'auto' is not supported: a conversation longer than the context "
    "is a 400",
    "background": "background responses are not supported",
    "service_tier": "service tiers are not supported: there is one tier",
    "top_logprobs": "logprobs are not returned by /v1/responses",
    "include": "no extra output data can be included",
    "reasoning": "reasoning options are not supported: the model is not a reasoning model",
    "stream_options": "no stream options are supported (no obfuscation is added)",
    "max_tool_calls": "max_tool_calls is not supported",
}
_TOOL = frozenset({"type", "name", "description", "parameters", "strict"})


@dataclass(slots=True)
class ResponsesRequest:
    parsed: ParsedRequest
    history: list[
        dict[str, Any]
    ]  # chat messages of the conversation, this input last; no instructions
    input_items: list[dict[str, Any]]  # this request's input, as GET .../input_items lists it
    echo: dict[str, Any]  # the request fields a response object repeats
    store: bool
    stream: bool


def parse_responses(
    body: Any, served: Served, previous: list[dict[str, Any]] | None
) -> ResponsesRequest:
    """previous: the stored conversation of previous_response_id (the caller looked it up)."""
    body = _check_top(body, served.reasoning_parser is not None)
    effort = _effort(body.get("reasoning")) if served.reasoning_parser is not None else None
    store, stream = typed(body, "store", bool, ""), typed(body, "stream", bool, "")
    history = [*(previous or []), *input_messages(body.get("input"))]
    items = input_items(body["input"])
    instructions = body.get("instructions")
    tools = [_tool(t, i) for i, t in enumerate(typed(body, "tools", list, "") or [])]
    forced = _forced(body.get("tool_choice"))
    chat: dict[str, Any] = {
        "model": typed(body, "model", str, ""),
        "messages": [{"role": "system", "content": instructions}] * (instructions is not None)
        + history,
        "tools": tools or None,
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": typed(body, "parallel_tool_calls", bool, ""),
        "max_tokens": typed(body, "max_output_tokens", int, ""),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
    }
    if effort == "none":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    fmt = text_format(body.get("text"))
    if not forced:  # a forced tool call is the whole output: there is no text to format
        chat["response_format"] = fmt
    try:
        parsed = parse_chat(chat, served)
    except InvalidRequest as e:
        if e.param == "chat_template_kwargs.enable_thinking":
            raise InvalidRequest(
                "reasoning.effort 'none' cannot be honoured: the chat template has no "
                "enable_thinking switch",
                param="reasoning.effort",
            ) from None
        e.param = _RENAMED.get(e.param or "", e.param)
        raise
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": chat["parallel_tool_calls"] is not False,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "text": {"format": fmt or {"type": "text"}} if body.get("text") is None else body["text"],
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "user": body.get("user"),
        "store": store is not False,
        "reasoning": {"effort": effort, "summary": None},
    }
    return ResponsesRequest(parsed, history, items, echo, store is not False, stream is True)


def _check_top(value: Any, reasons: bool) -> dict[str, Any]:
    """Unknown and unsupported top-level fields refused, the labels type-checked; reasons: the
    server splits reasoning (--reasoning-parser), and _effort checks the reasoning field."""
    body = obj_at(value, "the request body")
    known(body, TOP | set(REFUSED), "")
    for key in (*REFUSED, *WHY):
        value = body.get(key)
        if key == "reasoning" and reasons:
            continue
        if value is not None and not _neutral(key, value):
            raise InvalidRequest(
                f"{key} is not supported: {REFUSED.get(key) or WHY[key]}", param=key
            )
    for key in (
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "previous_response_id",
        "instructions",
    ):
        typed(body, key, str, "")
    metadata(body.get("metadata"), "metadata")
    return body


def _effort(value: Any) -> str | None:
    """With --reasoning-parser: the reasoning field -> its effort, None or "none". The model
    reasons as long as it does; "none" turns thinking off through the chat template's
    enable_thinking. Other efforts and summaries cannot be honoured: a 400 naming them."""
    if value is None:
        return None
    value = obj_at(value, "reasoning")
    known(value, frozenset({"effort", "summary", "generate_summary"}), "reasoning")
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None:
            raise InvalidRequest(
                f"reasoning.{key} is not supported: the reasoning is returned whole "
                "(a reasoning item's content), never summarized",
                param=f"reasoning.{key}",
            )
    effort: str | None = value.get("effort")
    if effort not in (None, "none"):
        raise InvalidRequest(
            f"reasoning.effort {str(effort)[:50]!r} is not supported: the model's reasoning "
            "length cannot be steered; only 'none' (thinking off, through the chat template's "
            "enable_thinking) is",
            param="reasoning.effort",
        )
    return effort


def _neutral(key: str, value: Any) -> bool:
    if isinstance(value, dict):  # {"effort": null} asks for nothing
        value = {k: v for k, v in value.items() if v is not None}
    return any(type(value) is type(v) and value == v for v in NEUTRAL.get(key, ()))


_RENAMED = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


def _tool(tool: Any, i: int) -> dict[str, Any]:
    path = f"tools[{i}]"
    tool = obj_at(tool, path)
    if tool.get("type") != "function":
        raise InvalidRequest(
            f"{path}.type {str(tool.get('type'))[:50]!r} is not supported: only function "
            "tools are (no built-in tools such as web search)",
            param=f"{path}.type",
        )
    known(tool, _TOOL, path)
    typed(tool, "strict", bool, path)
    fn = {"name": typed(tool, "name", str, path, required=True)}
    for key, want in (("description", str), ("parameters", dict)):
        if typed(tool, key, want, path) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # parse_chat checks the mode
    choice = obj_at(choice, "tool_choice")
    if choice.get("type") != "function":
        raise InvalidRequest(
            f"tool_choice type {str(choice.get('type'))[:50]!r} is not supported: give "
            '"none", "auto", "required" or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    known(choice, frozenset({"type", "name"}), "tool_choice")
    return {
        "type": "function",
        "function": {"name": typed(choice, "name", str, "tool_choice", True)},
    }


def _forced(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, dict)


def text_format(text: Any) -> dict[str, Any] | None:
    """text: {format, verbosity} -> a chat response_format (None: plain text)."""
    if text is None:
        return None
    text = obj_at(text, "text")
    known(text, frozenset({"format", "verbosity"}), "text")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequest("text.verbosity is not supported", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = obj_at(fmt, "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        known(fmt, frozenset({"type"}), "text.format")
        return None if kind == "text" else {"type": "json_object"}
    if kind != "json_schema":
        raise InvalidRequest(
            f"text.format.type must be text, json_object or json_schema, got {str(kind)[:50]!r}",
            param="text.format.type",
        )
    known(fmt, frozenset({"type", "name", "schema", "strict", "description"}), "text.format")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    typed(fmt, "name", str, "text.format", required=True)
    typed(fmt, "schema", dict, "text.format", required=True)
    typed(fmt, "description", str, "text.format")
    return {"type": "json_schema", "json_schema": spec}
