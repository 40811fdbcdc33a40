"""The streaming parsers give the same result whatever the delta sizes (property-based,
hypothesis): a delta can carry several tokens (a slow reader's merged deltas, speculative
decoding), or one character of a tag. For every way of cutting a text into deltas, the joined
stream equals the parsers' answer for the whole text, which is what a non-streaming response
carries."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.reasoning import ReasoningStream, split_reasoning
from gateway.tools import ToolStream, parse_tools

NAMES = ["get_weather", "get_time"]
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES
]
ARGS = st.dictionaries(
    st.sampled_from(["city", "n", "x y", "<tool_call>"]),
    st.one_of(st.integers(-5, 5), st.text(alphabet='ab <>/{}"\n', max_size=6)),
    max_size=3,
)
TEXT = st.text(alphabet="ab {}<>/\n", max_size=12)  # content with the tags' characters in it
# Pieces of reasoning outputs: the tags whole, their fragments, and ordinary text.
THINK = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "b c", " ", "\n"]),
    max_size=12,
).map("".join)


def cut(text: str, data: st.DataObject) -> list[str]:
    """text cut at any set of points (deltas of any size, empty ones included)."""
    points = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@st.composite
def tool_outputs(draw: Any) -> tuple[str, str]:
    """(parser, a model's output): content, hermes or Llama 3 JSON calls, and text around them."""
    parser = draw(st.sampled_from(["hermes", "llama3_json", "auto"]))
    calls = draw(st.lists(st.tuples(st.sampled_from(NAMES), ARGS), max_size=3))
    if draw(st.booleans()):  # Llama 3 JSON: the whole output is calls joined by ";"
        body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
        return parser, draw(
            st.sampled_from(["", " ", "\n", "<|python_tag|>", " <|python_tag|> "])
        ) + body
    newline = st.sampled_from(["", "\n"])
    blocks = [
        f"<tool_call>{draw(newline)}{json.dumps({'name': n, 'arguments': a})}{draw(newline)}"
        "</tool_call>"
        for n, a in calls
    ]
    seps = [draw(TEXT) for _ in range(len(blocks) + 1)]
    text = seps[0] + "".join(b + s for b, s in zip(blocks, seps[1:]))
    if draw(st.booleans()):
        text += draw(
            st.sampled_from(['<tool_call>{"name": ', "<tool", "<"])
        )  # cut off by max_tokens
    return parser, text


def stream_tools(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    tools = parse_tools({"tools": TOOLS}, parser)
    assert tools is not None
    ts = ToolStream(tools)
    sent = "".join(ts.feed(p) for p in pieces)
    rest, calls = ts.finish()
    return sent + rest, [(c.name, c.arguments) for c in calls]


@settings(max_examples=400, deadline=None)
@given(tool_outputs(), st.data())
def test_tool_call_stream_equals_the_whole_text_parsed(
    case: tuple[str, str], data: st.DataObject
) -> None:
    parser, text = case
    tools = parse_tools({"tools": TOOLS}, parser)
    assert tools is not None
    content, calls = tools.parse(text)
    assert stream_tools(parser, cut(text, data)) == (
        content or "",
        [(c.name, c.arguments) for c in calls],
    )


def stream_reasoning(opened: bool, pieces: list[str]) -> tuple[str, str]:
    rs = ReasoningStream(opened)
    parts = [rs.feed(p) for p in pieces] + [rs.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@settings(max_examples=400, deadline=None)
@given(THINK, st.booleans(), st.data())
def test_reasoning_stream_equals_the_whole_text_split(
    text: str, opened: bool, data: st.DataObject
) -> None:
    assert stream_reasoning(opened, cut(text, data)) == split_reasoning(text, opened)


def test_the_split_at_the_tags() -> None:
    assert split_reasoning("<think>\nhmm</think>\n\nParis.", False) == ("\nhmm", "\n\nParis.")
    assert split_reasoning("hmm</think>Paris.", True) == ("hmm", "Paris.")
    assert split_reasoning("Paris.", False) == ("", "Paris.")
    assert split_reasoning("still thinking", True) == ("still thinking", "")
    assert split_reasoning("  <think>a", False) == ("a", "")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["", "<think>", "\n<think>"]), THINK, tool_outputs(), st.data())
def test_reasoning_then_tool_calls_as_the_chat_stream_splits_them(
    head: str, thought: str, case: tuple[str, str], data: st.DataObject
) -> None:
    """gateway/choice_stream.py's per-choice split (reasoning parser, then the tool-call parser on
    the content) against the non-streaming path (split_reasoning, then Tools.parse), for a prompt
    that opened <think>."""
    from gateway.choice_stream import ChoiceSplit
    from gateway.openai_schema import ParsedRequest
    from gateway.reasoning import Reasoning
    from shared.sampling import SamplingParams

    parser, answer = case
    text = f"{head}{thought.replace('</think>', '')}</think>{answer}"
    tools = parse_tools({"tools": TOOLS}, parser)
    req = ParsedRequest(
        [1], SamplingParams(), True, False, tools=tools, reasoning=Reasoning("qwen3", True)
    )
    split = ChoiceSplit(req)
    pieces = cut(text, data)
    parts = [split.feed(p, final=False) for p in pieces] + [split.feed("", final=True)]
    want_thought, want_answer = split_reasoning(text, True)
    assert tools is not None
    content, calls = tools.parse(want_answer)
    assert "".join(p[0] for p in parts) == want_thought
    assert "".join(p[1] for p in parts) == (content or "")
    assert [(c.name, c.arguments) for p in parts for c in p[2]] == [
        (c.name, c.arguments) for c in calls
    ]
