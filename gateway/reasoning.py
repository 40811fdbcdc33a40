"""Reasoning models: a chat answer's `<think>...</think>` part split from the answer, over a stream.

One piece for every front door: `ReasoningStream.feed(text) -> (reasoning, content)` turns the
detokenized text of one choice, in deltas of any size, into the reasoning and the content that may
go out now, and `finish()` flushes what a possible tag held back. `split_reasoning` is the same over
a whole text; whichever way a text is cut into deltas, the joined stream equals it
(tests/gateway/test_stream_splits.py). Chat completions render the parts as `reasoning_content`
(gateway/streaming.py); the Responses API can render them as a `reasoning` item, Anthropic's
Messages as a `thinking` block.

`--reasoning-parser` `qwen3` or `deepseek_r1` (Qwen3, QwQ and the DeepSeek-R1 distills):
- reasoning is what comes before `</think>`, when the output starts inside a think block: the
  output begins with `<think>` (leading whitespace aside), or the prompt opened one and did not
  close it (a template whose generation prompt ends with `<think>\\n`, as DeepSeek-R1's), or the
  parser is `deepseek_r1` (R1 thinks first always; its older template did not open the block, and
  the model may not write the open tag either);
- content is everything after `</think>`, or the whole output when no think block opened it (Qwen3
  with `chat_template_kwargs: {"enable_thinking": false}`, whose template closes an empty block in
  the prompt). An output cut before `</think>` is all reasoning.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from gateway.fields import known, obj_at, typed
from shared.errors import InvalidRequest
from shared.sampling import SamplingParams
from shared.thinking import MAX_SPELLINGS
from shared.tokenizer import encode

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"
# What a model writes around a tag: each (before, after) pair gives its tokens in that context.
AROUND = ("", " ", "\n", ".", ",", ":", "!", "?", ")", "]", "*", "`", '"', "'", ">", "a")


@dataclass(frozen=True, slots=True)
class Reasoning:
    """One chat request's reasoning settings: how its output starts, and whether
    reasoning is returned."""

    parser: str
    opened: bool  # the output starts inside a think block (the prompt opened it, or deepseek_r1)
    include: bool = True  # vLLM's include_reasoning: false drops the reasoning from the response


def spellings(tokenizer: Any, tag: str) -> tuple[tuple[int, ...], ...]:
    """A tag's spellings in context other than its ids alone, as the tokenizer writes the text
    around it in AROUND, first found first: the tokens whose text covers the tag. Found once per
    served tokenizer (gateway/app.py), so the engine ends a thinking budget on any of them
    (shared/thinking.py). A one-token tag, or a tokenizer without offsets, has its ids alone."""
    alone = tuple(encode(tokenizer, tag, add_special_tokens=False))
    found = dict.fromkeys([alone])
    for left, right in itertools.product(AROUND, repeat=2) if len(alone) > 1 else ():
        try:
            enc = tokenizer(f"x{left}{tag}{right}x", add_special_tokens=False,
                            return_offsets_mapping=True)
        except NotImplementedError:  # a slow tokenizer
            return ()
        a, b = 1 + len(left), 1 + len(left) + len(tag)  # the tag's characters
        found[tuple(t for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
                    if s < b and e > a)] = None
    return tuple(found)[1:1 + MAX_SPELLINGS]


def parse_reasoning(body: dict[str, Any], parser: str | None, tokenizer: Any, ids: list[int],
          params: SamplingParams, end_spellings: tuple[tuple[int, ...], ...] = (),
          ) -> tuple[Reasoning | None, SamplingParams]:
    """A chat body's reasoning fields -> how its output starts (the prompt's tail says whether it
    opened <think>), and params with the tags' ids, by which the engine enforces vLLM's
    thinking_token_budget and the gateway counts reasoning_tokens (shared/thinking.py), and with a
    budget the end tag's other spellings (`spellings`), by which the engine sees the model end its
    reasoning itself. Without a parser, a reasoning field is a 400."""
    include, budget = body.get("include_reasoning"), body.get("thinking_token_budget")
    if include is not None and not isinstance(include, bool):
        raise InvalidRequest(f"include_reasoning must be true or false, got {repr(include)[:100]}",
                             param="include_reasoning")
    if parser is None:
        for key in ("include_reasoning", "thinking_token_budget"):
            if body.get(key) is not None:
                raise InvalidRequest(f"{key} is not supported: this server splits no reasoning "
                                     "(start it with --reasoning-parser)", param=key)
        return None, params
    tail = tokenizer.decode(ids[-256:], skip_special_tokens=False)
    opened = parser == "deepseek_r1" or prompt_opens(tail)
    start = () if opened else tuple(encode(tokenizer, OPEN, add_special_tokens=False))
    end = tuple(encode(tokenizer, CLOSE, add_special_tokens=False))
    spelled = end_spellings if budget is not None else ()  # only a budget reads them
    params = dataclasses.replace(params, reasoning_start_ids=start, reasoning_end_ids=end,
                                 thinking_token_budget=budget,  # validated there: a 400 naming it
                                 reasoning_end_spellings=spelled)
    return Reasoning(parser, opened, include is not False), params


def anthropic_thinking(value: Any, reasons: bool, max_tokens: int | None) -> dict[str, Any]:
    """Anthropic's thinking -> chat fields. Without --reasoning-parser only "disabled" is accepted
    (the model does not reason). With one: "disabled" -> enable_thinking false (a 400 where the
    template has no such switch); "adaptive" and "enabled" -> the template's default, and an enabled
    budget_tokens below max_tokens -> thinking_token_budget (one at or above it binds nothing that
    max_tokens does not, and is left out, so it refuses no grammar). max_tokens None: count_tokens,
    which generates nothing."""
    if value is None:
        return {}
    value = obj_at(value, "thinking")
    kind = value.get("type")
    if not reasons and kind != "disabled":
        raise InvalidRequest(
            "thinking is not supported: the model is not a reasoning model (only "
            '{"type": "disabled"}; start the server with --reasoning-parser)',
            param="thinking",
        )
    allowed = {"disabled": {"type"}, "adaptive": {"type", "display"},
               "enabled": {"type", "display", "budget_tokens"}}
    if kind not in allowed:
        raise InvalidRequest("thinking.type must be enabled, adaptive or disabled",
                             param="thinking.type")
    known(value, frozenset(allowed[kind]), "thinking")
    if value.get("display") not in (None, "summarized"):
        raise InvalidRequest(
            "thinking.display 'omitted' is not supported: the thinking is returned whole",
            param="thinking.display",
        )
    if kind == "enabled":
        budget = typed(value, "budget_tokens", int, "thinking", required=True)
        if budget < 1024:  # Anthropic's minimum
            raise InvalidRequest("thinking.budget_tokens must be at least 1024",
                                 param="thinking.budget_tokens")
        if max_tokens is not None and budget < max_tokens:
            return {"thinking_token_budget": budget}
    if kind == "disabled" and reasons:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    return {}


def prompt_opens(prompt_text: str) -> bool:
    """Does the rendered prompt end inside a think block (its last `<think>` after its last
    `</think>`)?"""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def split_reasoning(text: str, opened: bool) -> tuple[str, str]:
    """A whole output -> (reasoning, content)."""
    body = text.lstrip()
    if body.startswith(OPEN):
        text, opened = body[len(OPEN):], True
    if not opened:
        return "", text
    end = text.find(CLOSE)
    return (text, "") if end < 0 else (text[:end], text[end + len(CLOSE):])


def _partial(text: str, tag: str) -> int:
    """How many trailing characters of text are a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's split, delta by delta: holds back only what may still become a tag."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """New text -> (reasoning, content) that may go out now."""
        self.held += text
        if self.state == "start":
            body = self.held.lstrip()
            if len(body) < len(OPEN) and OPEN.startswith(body):
                return "", ""  # may still become the open tag
            if body.startswith(OPEN):
                self.held, self.state = body[len(OPEN):], "reasoning"
            else:
                self.state = "reasoning" if self.opened else "content"
        if self.state == "content":
            out, self.held = self.held, ""
            return "", out
        end = self.held.find(CLOSE)
        if end >= 0:
            thought, rest = self.held[:end], self.held[end + len(CLOSE):]
            self.held, self.state = "", "content"
            return thought, rest
        keep = _partial(self.held, CLOSE)
        thought, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return thought, ""

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back, as what it turned out to be."""
        held, self.held = self.held, ""
        if self.state == "start":
            return split_reasoning(held, self.opened)
        return (held, "") if self.state == "reasoning" else ("", held)
