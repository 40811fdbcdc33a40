"""translate.events, the one stream the Responses and Messages doors render: however the engine's
text is split into deltas (a delta can carry several tokens), the content and the tool calls that
come out are the same as parsing the whole text at once (tools.parse_calls, the chat route's
non-streaming parser), up to the whitespace that parser strips around the content."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any, cast
from unittest.mock import patch

from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import translate
from gateway.openai_schema import ParsedRequest
from gateway.reasoning import Reasoning, split_reasoning
from gateway.state import CONFIG, GatewayConfig
from gateway.tools import Tools, parse_calls
from shared.choices import TextOutput
from shared.sampling import SamplingParams

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)
TEXTS = [
    "Sure. " + CALL,
    CALL + "\n" + CALL.replace("Paris", "Rome"),
    "No call here, just <tool text.",
    CALL,
]
TOOLS = Tools(
    [{"type": "function", "function": {"name": "get_weather"}}], "auto", None, True, "hermes"
)


class _Req:
    tools: Tools | None = TOOLS
    reasoning: Reasoning | None = None
    params, score_only, echo = SamplingParams(), False, None


def _collect(pieces: list[str], interval: int, req: _Req | None = None) -> list[Any]:
    async def fake_run(app: Any, req: Any, rid: str) -> AsyncGenerator[TextOutput, None]:
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield TextOutput(rid, piece, [0], last, "stop" if last else None, 5, i + 1)

    async def run() -> list[Any]:
        app = web.Application()
        app[CONFIG] = GatewayConfig(stream_interval=interval)
        # _Req stands in for the ParsedRequest fields events reads (tools, reasoning)
        parsed = cast(ParsedRequest, req or _Req())
        with patch.object(translate, "run_request", fake_run):
            return [e async for e in translate.events(app, parsed, "r")]

    return asyncio.run(run())


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=8), st.integers(1, 4))
def test_any_split_gives_the_whole_texts_content_and_calls(
    text: str, cuts: list[int], interval: int
) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [text]
    events = _collect(pieces, interval)
    assert isinstance(events[0], translate.Started) and isinstance(events[-1], translate.End)
    content = "".join(e.text for e in events if isinstance(e, translate.Text))
    calls = [e.call for e in events if isinstance(e, translate.Call)]
    want_content, want_calls = parse_calls(text, "hermes")
    assert content.strip() == (want_content or "")  # the whole-text parser strips the content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c.name, json.loads(c.arguments)) for c in want_calls
    ]
    texts = [i for i, e in enumerate(events) if isinstance(e, translate.Text)]
    assert all(
        i < min((j for j, e in enumerate(events) if isinstance(e, translate.Call)), default=99)
        for i in texts
    )  # content first, then the calls


THOUGHTS = ["a thought</think>the answer", "<think>a thought</think>the answer",
            "cut before the tag", " <think>x</thi", "</think>"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(THOUGHTS), st.lists(st.integers(0, 60), max_size=8), st.integers(1, 4))
def test_any_split_gives_the_whole_texts_reasoning_then_content(
    text: str, cuts: list[int], interval: int
) -> None:
    """With a reasoning parser (the prompt opened <think>): Thought events, then Text events, whose
    joins are split_reasoning's of the whole text."""
    req = _Req()
    req.tools, req.reasoning = None, Reasoning("qwen3", opened=True)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [text]
    events = _collect(pieces, interval, req)
    kinds = [type(e) for e in events if isinstance(e, (translate.Thought, translate.Text))]
    assert kinds == sorted(kinds, key=lambda k: k is translate.Text)  # no reasoning after content
    thought = "".join(e.text for e in events if isinstance(e, translate.Thought))
    content = "".join(e.text for e in events if isinstance(e, translate.Text))
    assert (thought, content) == split_reasoning(text, opened=True)
