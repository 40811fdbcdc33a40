"""Tool calls and structured-output fields at the gateway, without an engine: parsers, the streamed
hold-back, the shipped template's rendering, and which field spellings become which constraint."""
from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.structured import constraint_of
from gateway.templates import HERMES_CHATML, template_for
from gateway.tools import ToolStream, parse_calls, parse_tools
from shared.constraints import Constraint
from shared.errors import InvalidRequest
from shared.tokenizer import apply_chat_template
from tests.fakes import smollm2_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure.",
     [("f", {"a": 1})]),
    ("hermes",
     '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
               '{"b": "x"}}</tool_call>', None, [("f", {}), ("g", {"b": "x"})]),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 2}}', None, [("f", {"a": 2})]),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"c": [1]}}',
     None,
     [("f", {}), ("g", {"c": [1]})]),
    ("auto", '{"name": "f", "parameters": {"a": 2}}', None, [("f", {"a": 2})]),
    ("auto", '<tool_call>{"name": "f", "arguments": {"a": 3}}</tool_call>', None,
     [("f", {"a": 3})]),
    ("auto", "Just text {with braces}", "Just text {with braces}", []),
])
def test_parsers(parser: str, text: str, content: str | None, calls: list) -> None:
    got_content, got = parse_calls(text, parser)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("parser", ["hermes", "auto"])
def test_stream_sends_content_and_holds_what_may_be_a_call(parser: str) -> None:
    tools = parse_tools({"tools": TOOLS}, parser)
    assert tools is not None
    ts = ToolStream(tools)
    pieces = ["Let me ", "check.<tool", "_call>\n{\"name\": \"get_weather\", ",
              "\"arguments\": {\"city\": \"Oslo\"}}", "\n</tool_call>"]
    sent = "".join(ts.feed(p) for p in pieces)
    rest, calls = ts.finish()
    assert sent == "Let me check." and rest == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    plain = ToolStream(tools)
    assert "".join(plain.feed(p) for p in ["a <tool", " b"]) + plain.finish()[0] == "a <tool b"


def test_shipped_template_renders_tools_calls_and_results() -> None:
    tok = smollm2_tokenizer()
    template = template_for(tok, None, uses_tools=True)
    assert template == HERMES_CHATML and template_for(tok, None, uses_tools=False) is None
    assert template_for(tok, "{{ x }}", uses_tools=False) == "{{ x }}"  # --chat-template wins
    messages: list[dict[str, Any]]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    text = tok.decode(apply_chat_template(tok, messages, tools=TOOLS, template=template))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI model.")
    assert '"name": "get_weather"' in text and "<tools>" in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert call in text
    assert "<|im_start|>user\n<tool_response>\n12 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n") and text.count("Be brief.") == 1


def test_tool_choice_shapes() -> None:
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, "auto") is None
    named = parse_tools({"tools": TOOLS,
                         "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                         "parallel_tool_calls": False}, "hermes")
    assert named is not None and named.choice == "named" and not named.parallel
    c = named.constraint()
    assert c is not None and c.kind == "structural_tag"
    assert json.loads(c.value)["format"]["stop_after_first"]
    auto = parse_tools({"tools": TOOLS}, "auto")
    assert auto is not None and auto.constraint() is None
    bad: dict[str, Any]
    for bad in ({"tool_choice": "required"}, {"tools": []},
                {"tools": [{"type": "function", "function": {}}]},
                {"tools": TOOLS, "tool_choice": "always"},
                {"tools": TOOLS, "parallel_tool_calls": "yes"}):
        with pytest.raises(InvalidRequest):
            parse_tools(bad, "auto")


def test_field_spellings_become_constraints() -> None:
    schema = {"type": "object"}
    compact = json.dumps(schema, separators=(",", ":"))
    assert constraint_of({"response_format": {"type": "text"}}) is None
    assert constraint_of({"response_format": {"type": "json_object"}}) == Constraint("json_object")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert constraint_of({"response_format": fmt}) == Constraint("json", compact)
    assert (constraint_of({"guided_json": json.dumps(schema)})
            == constraint_of({"structured_outputs": {"json": schema}}))
    assert (constraint_of({"guided_choice": ["a", "b"]})
            == constraint_of({"structured_outputs": {"choice": ["a", "b"]}}))
    assert constraint_of({"guided_regex": "a+"}) == Constraint("regex", "a+")
    assert (constraint_of({"structured_outputs": {"grammar": "root ::= \"a\""}})
            == Constraint("grammar", 'root ::= "a"'))
    bad: dict[str, Any]
    for bad in ({"guided_regex": "a", "guided_choice": ["a"]},
                {"structured_outputs": {"regex": "a", "choice": ["a"]}},
                {"structured_outputs": {"whitespace_pattern": " "}}, {"guided_choice": []},
                {"guided_json": "{"}, {"response_format": {"type": "json_schema"}},
                {"response_format": "json"}):
        with pytest.raises(InvalidRequest):
            constraint_of(bad)
