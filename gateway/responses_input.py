"""A Responses API `input` -> chat messages (what the template renders), and the input items as
GET /v1/responses/{id}/input_items lists them.

    a string                                  -> one user message
    message items (text parts)                -> messages (developer -> system)
    function_call items                       -> the assistant message's tool_calls (consecutive
                                                 calls: one message)
    function_call_output items                -> tool messages
    reasoning items (this server's own, sent  -> the next assistant message's reasoning_content:
    back by a client that keeps its context)     the chat template decides whether to show it
                                                 (Qwen3's shows it only after the last user turn)
Every key of every item is known or refused with a 400 naming its path.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from gateway.fields import known, obj_at, typed
from shared.errors import InvalidRequest

_MESSAGE = frozenset({"type", "role", "content", "id", "status"})
_FUNCTION_CALL = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
_CALL_OUTPUT = frozenset({"type", "call_id", "output", "id", "status"})
_REASONING = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})
_TEXT_PART = frozenset({"type", "text", "annotations", "logprobs"})
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The input (a string, or a list of items) -> chat messages; consecutive function_call items
    become one assistant message with several tool_calls."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, waiting for its assistant message
    for i, item in enumerate(value):
        path = f"input[{i}]"
        item = obj_at(item, path)
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought = (thought or "") + _reasoning(item, path)
            continue
        if kind == "message":
            out.append(_message(item, path))
        elif kind == "function_call":
            call = _function_call(item, path)
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            known(item, _CALL_OUTPUT, path)
            call_id = typed(item, "call_id", str, path, required=True)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _text_of(item.get("output"), f"{path}.output", "input_text"),
                }
            )
        else:
            raise InvalidRequest(
                f"{path}.type {str(kind)[:50]!r} is not supported (message, function_call, "
                "function_call_output and reasoning are)",
                param=f"{path}.type",
            )
        if thought is not None:
            if out[-1]["role"] != "assistant":
                raise _unattached(i - 1)
            out[-1]["reasoning_content"] = out[-1].get("reasoning_content", "") + thought
            thought = None
    if thought is not None:
        raise _unattached(len(value) - 1)
    return out


def _unattached(i: int) -> InvalidRequest:
    return InvalidRequest(
        f"input[{i}]: a reasoning item must be followed by the assistant's message or "
        "function_call it led to",
        param=f"input[{i}]",
    )


def _reasoning(item: dict[str, Any], path: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary_text parts."""
    known(item, _REASONING, path)
    if item.get("encrypted_content") is not None:
        raise InvalidRequest(
            f"{path}.encrypted_content cannot be read: this server makes no encrypted reasoning",
            param=f"{path}.encrypted_content",
        )
    texts = {}
    for key, part in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = typed(item, key, list, path, required=key == "summary") or []
        texts[key] = "".join(_part_text(p, f"{path}.{key}[{j}]", part) for j, p in enumerate(parts))
    return texts["content"] or texts["summary"]


def _part_text(p: Any, where: str, part: str) -> str:
    p = obj_at(p, where)
    known(p, frozenset({"type", "text"}), where)
    if p.get("type") != part:
        raise InvalidRequest(f"{where}.type must be {part}", param=f"{where}.type")
    text: str = typed(p, "text", str, where, required=True)
    return text


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    known(item, _MESSAGE, path)
    role = typed(item, "role", str, path, required=True)
    if role not in _ROLES:
        raise InvalidRequest(
            f"{path}.role must be one of {', '.join(_ROLES)}", param=f"{path}.role"
        )
    part = "output_text" if role == "assistant" else "input_text"
    return {"role": _ROLES[role], "content": _text_of(item.get("content"), f"{path}.content", part)}


def _text_of(content: Any, path: str, part: str) -> str:
    """A string, or a list of text parts (input_text; output_text for the assistant's own)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{path} must be a string or a list of {part} parts", param=path)
    texts = []
    for j, p in enumerate(content):
        where = f"{path}[{j}]"
        p = obj_at(p, where)
        if p.get("type") not in (part, "text", "input_text"):
            raise InvalidRequest(
                f"{where}.type {str(p.get('type'))[:50]!r} is not supported: only text "
                "parts are (no images, files or audio)",
                param=f"{where}.type",
            )
        known(p, _TEXT_PART, where)
        if p.get("annotations") or p.get("logprobs"):
            raise InvalidRequest(
                f"{where}: annotations and logprobs cannot be sent back",
                param=f"{where}.annotations",
            )
        texts.append(typed(p, "text", str, where, required=True))
    return "".join(texts)


def _function_call(item: dict[str, Any], path: str) -> dict[str, Any]:
    known(item, _FUNCTION_CALL, path)
    args = typed(item, "arguments", str, path, required=True)
    try:
        json.loads(args)
    except ValueError:
        raise InvalidRequest(
            f"{path}.arguments must be JSON text", param=f"{path}.arguments"
        ) from None
    return {
        "id": typed(item, "call_id", str, path, required=True),
        "type": "function",
        "function": {"name": typed(item, "name", str, path, required=True), "arguments": args},
    }


def input_items(value: Any) -> list[dict[str, Any]]:
    """An input input_messages accepted -> its items as OpenAI lists them: each with an id (the
    client's, or a new one), a status, and a message's content as typed text parts."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for given in value:
        kind = given.get("type", "message")
        item = {"type": kind, "id": f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}",
                "status": "completed", **{k: v for k, v in given.items() if v is not None}}
        if kind == "message":
            item["content"] = _parts(given["content"], given["role"] == "assistant")
        items.append(item)
    return items


def _parts(content: str | list[dict[str, Any]], assistant: bool) -> list[dict[str, Any]]:
    texts = [content] if isinstance(content, str) else [p["text"] for p in content]
    if assistant:
        return [{"type": "output_text", "text": t, "annotations": []} for t in texts]
    return [{"type": "input_text", "text": t} for t in texts]
