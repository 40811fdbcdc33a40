"""An Anthropic Messages body (POST /v1/messages, /v1/messages/count_tokens) -> the one internal
request.

Translated into a chat-completions body and built by openai_schema.parse_chat (template, tools'
grammar, SamplingParams), as the Responses door does:

    system (string or text blocks)      -> a leading system message
    messages: text blocks               -> the message's content
              thinking blocks           -> the assistant message's reasoning_content
              tool_use blocks           -> the assistant message's tool_calls (input as JSON)
              tool_result blocks        -> tool messages (before the user's text, as Anthropic
                                           orders them)
    output_config.format (json_schema)  -> response_format json_schema (the grammar enforces it)
    tools [{name, description, input_schema}]  -> function tools
    tool_choice auto / any / tool / none       -> auto / required / named / none;
              disable_parallel_tool_use        -> parallel_tool_calls: false
    max_tokens, stop_sequences, temperature, top_p, top_k
                                        -> max_tokens, stop, temperature, top_p, top_k
    thinking (--reasoning-parser)       -> disabled: chat_template_kwargs enable_thinking false;
                                           enabled / adaptive: the template's default;
                                           budget_tokens below max_tokens: thinking_token_budget
                                           (anthropic_thinking)
`cache_control` is accepted wherever Anthropic allows it: the prefix cache serves repeated prefixes
without being asked. Every key at every depth is known or a 400 naming its path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.fields import known, obj_at, typed
from gateway.openai_schema import ParsedRequest, Served, parse_chat
from gateway.reasoning import anthropic_thinking
from shared.errors import InvalidRequest

TOP = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "tools",
        "tool_choice",
        "thinking",
        "service_tier",
        "output_config",
        "cache_control",
    }
)
COUNT_TOP = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
REFUSED = {
    "container": "containers are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
}
_TEXT = frozenset({"type", "text", "cache_control", "citations"})
_TOOL_USE = frozenset({"type", "id", "name", "input", "cache_control"})
_TOOL_RESULT = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
_TOOL = frozenset({"type", "name", "description", "input_schema", "cache_control"})
_RENAMED = {"stop": "stop_sequences", "response_format": "output_config.format",
            "thinking_token_budget": "thinking.budget_tokens"}


@dataclass(slots=True)
class MessagesRequest:
    parsed: ParsedRequest
    stream: bool


def parse_messages_body(body: Any, served: Served, count: bool = False) -> MessagesRequest:
    """count: the body of /v1/messages/count_tokens (no max_tokens, no sampling fields)."""
    body = obj_at(body, "the request body")
    for key in body:
        if key in REFUSED and body[key] is not None:
            raise InvalidRequest(f"{key} is not supported: {REFUSED[key]}", param=key)
    known(body, (COUNT_TOP if count else TOP) | set(REFUSED), "")
    _cache_control(body, "")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise InvalidRequest("service_tier must be auto or standard_only", param="service_tier")
    max_tokens = 1 if count else typed(body, "max_tokens", int, "", required=True)
    thinking = anthropic_thinking(body.get("thinking"), served.reasoning_parser is not None,
                                  None if count else max_tokens)
    messages = [*_system(body.get("system")), *_messages(body.get("messages"))]
    metadata = typed(body, "metadata", dict, "")
    if metadata is not None:
        known(metadata, frozenset({"user_id"}), "metadata")
        typed(metadata, "user_id", str, "metadata")
    temperature = typed(body, "temperature", (int, float), "")
    if temperature is not None and not 0 <= temperature <= 1:
        raise InvalidRequest("temperature must be in [0, 1]", param="temperature")
    stop = typed(body, "stop_sequences", list, "") or []
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise InvalidRequest(
                f"stop_sequences[{i}] must be a non-empty string", param="stop_sequences"
            )
    tools = [_tool(t, i) for i, t in enumerate(typed(body, "tools", list, "") or [])]
    chat: dict[str, Any] = {
        "model": typed(body, "model", str, ""),
        "messages": messages,
        "max_tokens": max_tokens,
        "stop": stop or None,
        "temperature": temperature,
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "tools": tools or None,
        **_tool_choice(body.get("tool_choice"), bool(tools)),
        "response_format": _output_format(body.get("output_config")),
        **thinking,
    }
    try:
        parsed = parse_chat(chat, served)
    except InvalidRequest as e:
        if e.param == "chat_template_kwargs.enable_thinking":
            raise InvalidRequest(
                'thinking {"type": "disabled"} cannot be honoured: the chat template has no '
                "enable_thinking switch",
                param="thinking",
            ) from None
        if e.param in _RENAMED:  # the Messages API's name, in the param and the message
            old, e.param = e.param, _RENAMED[e.param]
            if str(e).startswith(old):
                e.args = (e.param + str(e)[len(old):],)
        raise
    return MessagesRequest(parsed, typed(body, "stream", bool, "") is True)


def _output_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    value = obj_at(value, "output_config")
    known(value, frozenset({"effort", "format"}), "output_config")
    if value.get("effort") is not None:
        raise InvalidRequest(
            "output_config.effort is not supported: the model is not a reasoning model",
            param="output_config.effort",
        )
    fmt = value.get("format")
    if fmt is None:
        return None
    fmt = obj_at(fmt, "output_config.format")
    known(fmt, frozenset({"type", "schema"}), "output_config.format")
    if fmt.get("type") != "json_schema":
        raise InvalidRequest(
            "output_config.format.type must be json_schema", param="output_config.format.type"
        )
    schema = typed(fmt, "schema", dict, "output_config.format", required=True)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest("system must be a string or a list of text blocks", param="system")
    return [
        {
            "role": "system",
            "content": "".join(_text_block(b, f"system[{i}]") for i, b in enumerate(value)),
        }
    ]


def _text_block(block: Any, path: str) -> str:
    block = obj_at(block, path)
    if block.get("type") != "text":
        raise InvalidRequest(f"{path}.type must be text", param=f"{path}.type")
    known(block, _TEXT, path)
    _cache_control(block, path)
    if block.get("citations"):
        raise InvalidRequest(f"{path}.citations are not supported", param=f"{path}.citations")
    text: str = typed(block, "text", str, path, required=True)
    return text


def _cache_control(block: dict[str, Any], path: str) -> None:
    cc = block.get("cache_control")
    if cc is None:
        return
    where = f"{path}.cache_control" if path else "cache_control"
    cc = obj_at(cc, where)
    known(cc, frozenset({"type", "ttl"}), where)
    if cc.get("type") != "ephemeral" or cc.get("ttl") not in (None, "5m", "1h"):
        raise InvalidRequest(f'{where} must be {{"type": "ephemeral"}} (ttl 5m or 1h)', param=where)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        path = f"messages[{i}]"
        m = obj_at(m, path)
        known(m, frozenset({"role", "content"}), path)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"{path}.role must be user or assistant", param=f"{path}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidRequest(
                f"{path}.content must be a string or a list of blocks", param=f"{path}.content"
            )
        out += _blocks(role, content, f"{path}.content")
    if out[-1]["role"] == "assistant":
        last = f"messages[{len(value) - 1}]"
        raise InvalidRequest(
            f"{last}: a last assistant message (prefill) is not supported: end with a user message",
            param=last,
        )
    return out


def _blocks(role: str, blocks: list[Any], path: str) -> list[dict[str, Any]]:
    """One message's blocks -> chat messages (tool results, then text; or text and calls, with
    the thinking as reasoning_content: the chat template decides whether to show it)."""
    texts, calls, results, thoughts = [], [], [], []
    for j, block in enumerate(blocks):
        where = f"{path}[{j}]"
        kind = obj_at(block, where).get("type")
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind == "thinking" and role == "assistant":
            known(block, frozenset({"type", "thinking", "signature"}), where)
            typed(block, "signature", str, where)
            thoughts.append(typed(block, "thinking", str, where, required=True))
        else:
            raise InvalidRequest(
                f"{where}.type {str(kind)[:50]!r} is not supported in a {role} message "
                "(text; tool_use and thinking from the assistant; tool_result from the user)",
                param=f"{where}.type",
            )
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            msg["tool_calls"] = calls
        elif not texts:
            msg["content"] = ""
        if thoughts:
            msg["reasoning_content"] = "".join(thoughts)
        return [msg]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tool_use(block: dict[str, Any], path: str) -> dict[str, Any]:
    known(block, _TOOL_USE, path)
    _cache_control(block, path)
    args = typed(block, "input", dict, path, required=True)
    return {
        "id": typed(block, "id", str, path, required=True),
        "type": "function",
        "function": {
            "name": typed(block, "name", str, path, required=True),
            "arguments": json.dumps(args, ensure_ascii=False),
        },
    }


def _tool_result(block: dict[str, Any], path: str) -> dict[str, Any]:
    known(block, _TOOL_RESULT, path)
    _cache_control(block, path)
    content = block.get("content")
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{path}.content[{k}]") for k, b in enumerate(content))
    elif content is not None and not isinstance(content, str):
        raise InvalidRequest(
            f"{path}.content must be a string or text blocks", param=f"{path}.content"
        )
    text = content or ""
    if typed(block, "is_error", bool, path):
        text = f"Error: {text}"  # the template has no slot for it: the model reads it in the result
    return {
        "role": "tool",
        "tool_call_id": typed(block, "tool_use_id", str, path, required=True),
        "content": text,
    }


def _tool(tool: Any, i: int) -> dict[str, Any]:
    path = f"tools[{i}]"
    tool = obj_at(tool, path)
    if tool.get("type") not in (None, "custom"):
        raise InvalidRequest(
            f"{path}.type {str(tool.get('type'))[:50]!r} is not supported: only client "
            "tools with an input_schema are (no server tools such as web search)",
            param=f"{path}.type",
        )
    known(tool, _TOOL, path)
    _cache_control(tool, path)
    fn = {"name": typed(tool, "name", str, path, required=True)}
    if (
        typed(tool, "description", str, path) is not None
    ):  # in OpenAI's order: the template shows it
        fn["description"] = tool["description"]
    fn["parameters"] = typed(tool, "input_schema", dict, path, required=True)
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any, has_tools: bool) -> dict[str, Any]:
    """-> the chat fields tool_choice and parallel_tool_calls."""
    if choice is None:
        return {}
    choice = obj_at(choice, "tool_choice")
    kind = choice.get("type")
    allowed = {
        "auto": {"type", "disable_parallel_tool_use"},
        "any": {"type", "disable_parallel_tool_use"},
        "tool": {"type", "name", "disable_parallel_tool_use"},
        "none": {"type"},
    }
    if kind not in allowed:
        raise InvalidRequest(
            "tool_choice.type must be auto, any, tool or none", param="tool_choice.type"
        )
    known(choice, frozenset(allowed[kind]), "tool_choice")
    single = typed(choice, "disable_parallel_tool_use", bool, "tool_choice")
    if kind == "none":
        return {"tool_choice": "none"} if has_tools else {}
    mode: Any = {"auto": "auto", "any": "required"}.get(kind)
    if kind == "tool":
        mode = {
            "type": "function",
            "function": {"name": typed(choice, "name", str, "tool_choice", True)},
        }
    return {"tool_choice": mode, "parallel_tool_calls": False if single else None}
