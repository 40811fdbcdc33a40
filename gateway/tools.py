"""Tool calling: `tools`, `tool_choice` and `parallel_tool_calls` in; `tool_calls` out.

In: the tools reach the prompt through the chat template (`tools=` of apply_chat_template). A
template that does not know tools (SmolLM2's) is replaced, for ChatML models, by the Hermes-style
template in gateway/templates.py; `--chat-template FILE` overrides every request's template, as in
vLLM.
`tool_choice`: "none" leaves the tools out of the prompt; "auto" lets the model choose and parses
what it wrote; "required" and a named function constrain the output with the grammar engine to one
(or, with parallel_tool_calls, several) calls in the parser's format, whose arguments match the
function's JSON schema, so even a small model returns a valid call.

Out: a parser reads the calls from the text. `hermes` (Hermes / Qwen): `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks, the text outside them is content. `llama3_json`: the whole
output is `{"name": ..., "parameters": {...}}`, several joined by `;`. `auto`: hermes blocks if
there are any, else llama3 JSON if the whole text is such; text that is not a call stays content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from shared.constraints import Constraint
from shared.errors import InvalidRequest

PARSERS = ("hermes", "llama3_json", "auto")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's prefix of a call


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Tools:
    """A chat request's tools, as the gateway uses them: for the template, the
    constraint, the parser."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, validated
    choice: str  # "auto" | "required" | "named" ("none" never builds a Tools)
    named: str | None
    parallel: bool
    parser: str

    def constraint(self) -> Constraint | None:
        """required / named: the calls the output must be (an xgrammar structural tag); auto:
        none."""
        if self.choice == "auto":
            return None
        fns = [t["function"] for t in self.tools if self.named is None
               or t["function"]["name"] == self.named]
        tags = [_tag(fn, self.parser) for fn in fns]
        sep = "; " if self.parser == "llama3_json" else "\n"
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True,
               "stop_after_first": not self.parallel}
        return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The model's text -> (content, calls). A call naming an unknown tool stays content."""
        content, calls = parse_calls(text, self.parser)
        known = {t["function"]["name"] for t in self.tools}
        if any(c.name not in known for c in calls):
            return text, []
        return content, calls


def parse_tools(body: dict[str, Any], parser: str) -> Tools | None:
    """The request's tools (None: no tools, or tool_choice "none"); InvalidRequest naming the
    field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false",
                             param="parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("tools must be a non-empty list of tools", param="tools")
    names = [_check_tool(t, i) for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools must have distinct function names", param="tools")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if (choice.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)):
            raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": '
                                 '"function", "function": {"name": ...}}', param="tool_choice")
        if fn["name"] not in names:
            raise InvalidRequest(f"tool_choice names {fn['name']!r}, which is not among the "
                                 "tools"[:300], param="tool_choice")
        choice, named = "named", fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or a named function',
                             param="tool_choice")
    if choice == "none":
        return None
    return Tools(tools, choice, named, parallel is not False, parser)


def _check_tool(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}',
                             param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise InvalidRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ . or -",
                             param="tools")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                             param="tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise InvalidRequest(f"tools[{i}].function.description must be a string", param="tools")
    return name


def _tag(fn: dict[str, Any], parser: str) -> dict[str, Any]:
    """One function's call as the parser reads it: fixed text around the arguments' JSON schema."""
    schema = fn.get("parameters") or {"type": "object"}
    name = json.dumps(fn["name"])
    if parser == "llama3_json":
        begin, end = f'{{"name": {name}, "parameters": ', "}"
    else:
        begin, end = f'<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"
    # max_whitespace_cnt: no runs of whitespace, which a small model under greedy decoding can emit
    # forever
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def parse_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """-> (content or None, calls). Text that does not parse as calls is all content."""
    if parser in ("hermes", "auto") and OPEN_TAG in text:
        calls = [_call(m.group(1), "arguments") for m in _HERMES.finditer(text)]
        if calls and all(c is not None for c in calls):
            # trailing whitespace goes with the calls: a stream cannot take back what it sent
            content = _HERMES.sub("", text).rstrip()
            return content or None, [c for c in calls if c is not None]
        if parser == "hermes":
            return text, []
    if parser in ("llama3_json", "auto"):
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if body.startswith("{"):
            calls = [_call(part, "parameters") for part in body.split(";")]
            if all(c is not None for c in calls):
                return None, [c for c in calls if c is not None]
    return text, []


def _call(raw: str, args_key: str) -> ToolCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolStream:
    """One streamed choice of a request with tools: content goes out as it comes until a call may
    begin, then the rest is held and parsed at the end (the calls go out then: each its name first,
    then its arguments, OpenAI's delta shape). Trailing whitespace and a possible open tag are held
    back, so the joined content equals parse() of the whole text however it is cut into deltas
    (tests/gateway/test_stream_splits.py)."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.held = ""  # text not sent: a possible start of a call, or everything after one began
        self.calling = False
        self.sent = False  # content went out already (a Llama 3 JSON call can no longer begin)

    def feed(self, text: str) -> str:
        """New text -> the content that may go out now."""
        self.held += text
        if self.calling:
            return ""
        llama = self.tools.parser != "hermes" and not self.sent  # a Llama 3 call may still begin
        body = self.held.lstrip()
        if llama and body.startswith(("{", PYTHON_TAG)):
            start = 0  # a Llama 3 JSON call is the whole output
        else:
            start = self.held.find(OPEN_TAG) if self.tools.parser != "llama3_json" else -1
        if start >= 0:
            self.calling = True
            start = len(self.held[:start].rstrip())  # the whitespace before a call goes with it
            out, self.held = self.held[:start], self.held[start:]
            return out
        if llama and PYTHON_TAG.startswith(body):
            return ""  # only whitespace, or what may become the python tag, so far
        hermes = self.tools.parser != "llama3_json"
        keep = _partial_tag(self.held) if hermes else 0  # what may become "<tool_call>"
        before = self.held[:len(self.held) - keep]
        keep += len(before) - len(before.rstrip())  # and whitespace a call would swallow
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent = self.sent or bool(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """-> the held content still to send, and the calls."""
        content, calls = self.tools.parse(self.held)
        return content or "", calls


def _partial_tag(text: str) -> int:
    """How many trailing characters of text are a proper prefix of the open tag (or a leading
    '{')."""
    for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0


def stream_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The `tool_calls` deltas of a stream: per call, one with its id and name, one with its
    arguments."""
    out: list[dict[str, Any]] = []
    for i, c in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
    return out
