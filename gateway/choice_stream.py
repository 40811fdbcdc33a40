"""The one streaming loop of every door: one request's engine outputs -> per choice, what may go out
now (a `Delta`), which each door renders in its own shapes: chat and completions chunks
(gateway/streaming.py `chunks`), and the API-neutral events that the Responses and Messages doors
render (gateway/translate.py `events`).

Per choice: the reasoning parser, then the tool-call parser, split its text (`ChoiceSplit`); its
first output goes out at once (the role travels with it), and its first text or reasoning too; then
a delta every --stream-interval of its tokens, and its last. Logprobs travel with the text they
belong to. Tool calls come whole, on the choice's last delta.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from gateway.openai_output import chat_logprobs, completion_logprobs
from gateway.openai_schema import ParsedRequest
from gateway.reasoning import ReasoningStream
from gateway.tools import ToolCall, ToolStream
from shared.choices import TextOutput, TokenLogprob


@dataclass(frozen=True, slots=True)
class Delta:
    """What one choice sends now."""

    index: int
    first: bool  # the choice's first delta
    thought: str  # reasoning (--reasoning-parser, unless include_reasoning is false)
    text: str  # content (completions' echo: the prompt's text first)
    logprobs: dict[str, Any] | None  # OpenAI's logprobs object for text's tokens, when asked
    calls: list[ToolCall]  # on the choice's last delta, after its content
    out: TextOutput  # the output that released it: finish_reason, stop_string, the request's counts


class ChoiceStream:
    """One request's outputs (it closes them: that aborts the request in the engine) -> `deltas`.
    `last` is the latest output, whose counts are the request's (it may belong to a choice that a
    stop string ended, so no delta carries it)."""

    def __init__(self, req: ParsedRequest, outputs: AsyncGenerator[TextOutput, None],
                 interval: int, chat: bool) -> None:
        self.req, self.outputs, self.interval, self.chat = req, outputs, interval, chat
        self.last: TextOutput | None = None

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        req, want_lps = self.req, self.req.params.logprobs is not None
        choices: dict[int, tuple[ChoiceBuffer, ChoiceSplit]] = {}
        try:
            async for out in self.outputs:
                self.last = out
                c, split = choices.get(out.index) or choices.setdefault(
                    out.index, (ChoiceBuffer(), ChoiceSplit(req)))
                if c.ended:
                    continue
                thought, text, calls = split.feed(out.text, out.finish_reason is not None)
                c.add(out, text, thought, req.score_only)
                c.ended = out.finish_reason is not None or out.finished
                if not (c.first or c.ended or c.num_tokens >= self.interval or not c.spoke):
                    continue
                if not (any(c.text) or c.reasoning or c.logprobs or c.ended or c.first):
                    continue  # text held back (an unfinished character, a possible stop string)
                text, lps = c.take(self.chat, want_lps, req)
                thought = c.take_reasoning()
                yield Delta(out.index, c.first, thought, text, lps, calls, out)
                c.first, c.spoke = False, c.spoke or bool(text or thought)
        finally:
            await self.outputs.aclose()


class ChoiceBuffer:
    """What one choice has received and not sent yet (--stream-interval), and what a response
    needs."""

    __slots__ = ("text", "reasoning", "logprobs", "num_tokens", "first", "spoke", "ended",
                 "text_offset", "finish_reason", "prompt", "echoed")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []  # with --reasoning-parser: the reasoning not sent yet
        self.logprobs: list[TokenLogprob] = []
        self.num_tokens = 0  # since the last event
        self.first, self.ended = True, False
        self.spoke = False  # some text or reasoning went out
        self.text_offset = 0  # completions' text_offset of the next token
        self.finish_reason: str | None = None
        # prompt logprobs, from the choice's first output
        self.prompt: list[TokenLogprob] | None = None
        self.echoed = False

    def add(self, out: TextOutput, text: str, reasoning: str = "",
            score_only: bool = False) -> None:
        """out's text is text (what the split left of it) and reasoning."""
        if out.prompt_logprobs is not None and self.prompt is None:
            self.prompt = out.prompt_logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        if score_only:  # max_tokens 0: the one token the engine sampled is not part of the answer
            return
        self.text.append(text)
        if reasoning:
            self.reasoning.append(reasoning)
        self.num_tokens += len(out.token_ids)
        if out.logprobs:
            self.logprobs += out.logprobs

    def take_reasoning(self) -> str:
        text, self.reasoning = "".join(self.reasoning), []
        return text

    def take(self, chat: bool, want_logprobs: bool, req: ParsedRequest | None = None,
             ) -> tuple[str, dict[str, Any] | None]:
        """-> the text and logprobs object gathered since the last take; with completions' echo the
        prompt's text (and its tokens' logprobs) go first, in the first take."""
        text, entries = "".join(self.text), self.logprobs
        self.text, self.logprobs, self.num_tokens = [], [], 0
        if req is not None and req.echo is not None and not self.echoed:
            self.echoed = True
            text = req.echo + text
            k = req.params.logprobs or 0
            entries = [dataclasses.replace(e, top=e.top[:k]) for e in self.prompt or []] + entries
        if not want_logprobs:
            return text, None
        if chat:
            return text, chat_logprobs(entries)
        lps = completion_logprobs(entries, self.text_offset)
        self.text_offset += sum(len(e.token) for e in entries)
        return text, lps


class ChoiceSplit:
    """One streamed chat choice's text -> (reasoning, content, tool calls at the end): the
    reasoning parser first (--reasoning-parser), then the tool-call parser on the content; the text
    as it is for a request with neither (completions)."""

    __slots__ = ("reasoning", "tools", "include")

    def __init__(self, req: ParsedRequest) -> None:
        opened = req.reasoning.opened if req.reasoning is not None else None
        self.reasoning = ReasoningStream(opened) if opened is not None else None
        self.include = req.reasoning is not None and req.reasoning.include
        self.tools = ToolStream(req.tools) if req.tools is not None else None

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        thought, calls = "", list[ToolCall]()
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if final:
                more, rest = self.reasoning.finish()
                thought, text = thought + more, text + rest
        if self.tools is not None:
            text = self.tools.feed(text)
            if final:
                rest, calls = self.tools.finish()
                text += rest
        return (thought if self.include else ""), text, calls
