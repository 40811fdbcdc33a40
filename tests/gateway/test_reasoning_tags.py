"""Reasoning tags of several tokens, with a real tokenizer that has no `<think>` token (SmolLM2's):
the model may spell a tag otherwise than its ids alone (` </` after a space, `>` merged with what
follows). The split and reasoning_tokens must follow the text, streamed and not, whatever the tokens
per delta. The reference is the tokenizer's own decode: the reasoning ends at the first token whose
prefix decodes to a text holding `</think>`."""
from __future__ import annotations

from typing import Any

import pytest

from gateway.reasoning import CLOSE, split_reasoning
from shared import protocol as P
from shared import thinking
from shared.choices import Choice, TokenStrings
from shared.sampling import SamplingParams
from shared.tokenizer import encode
from tests.fakes import FakeEngine, smollm2_tokenizer
from tests.gateway.test_choices import CHAT, post
from tests.gateway.test_routes import gateway, run

# Outputs whose tags the tokenizer spells otherwise than encode("<think>") /
# encode("</think>") alone.
OUTPUTS = [
    "<think>\nI think so </think> Paris is the capital.",  # ' </' after a space
    "<think>hmm, so</think>.\n\nParis.",
    "<think> <think> a nested open tag, then the end</think>\n\nParis.",
    " <think>x</think>",
]


def reference_count(ids: list[int]) -> int:
    """Tokens up to and including the one that completes the end tag, by the tokenizer's decode."""
    tok = smollm2_tokenizer()
    return next(k for k in range(1, len(ids) + 1)
                if CLOSE in tok.decode(ids[:k], skip_special_tokens=True))


@pytest.mark.parametrize("text", [OUTPUTS[0], OUTPUTS[1], OUTPUTS[3]])
def test_the_tags_ids_alone_miss_these_outputs_tags(text: str) -> None:
    """The premise: by the tags' ids alone (what the engine sees), these outputs' reasoning never
    ends (a tag spelled ` </` or `>.`) or never starts (` <`)."""
    tok = smollm2_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    starts, end = encode(tok, "<think>",
                         add_special_tokens=False), encode(tok, CLOSE, add_special_tokens=False)
    assert len(starts) > 1 and len(end) > 1
    state = thinking.initial(starts, end, 0)
    for k in range(1, len(ids) + 1):
        state = thinking.after(state, ids[:k], 0, thinking.Tag(tuple(starts)),
                               thinking.Tag(tuple(end)))
    assert state is not None


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("opened", [False, True])
def test_reasoning_tokens_follow_the_text(text: str, opened: bool) -> None:
    tok = smollm2_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    starts = () if opened else tuple(encode(tok, "<think>", add_special_tokens=False))
    params = SamplingParams(max_tokens=64, reasoning_start_ids=starts,
                            reasoning_end_ids=tuple(encode(tok, CLOSE, add_special_tokens=False)))
    choice = Choice(tok, (), None, TokenStrings(tok), params)
    for i in ids:
        choice.step([i], None, False)
    assert choice.num_reasoning_tokens == reference_count(ids)


def chat_body(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": CHAT, "max_tokens": 64, "stream": stream}
    return body | ({"stream_options": {"include_usage": True}} if stream else {})


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("per_step", [1, 3])
def test_chat_split_and_usage_agree_streamed_and_not(text: str, per_step: int) -> None:
    """Through the gateway (SmolLM2's template opens no block): reasoning_content, content
    and reasoning_tokens equal the text's split and the tokenizer's count, in a response and
    in a stream."""
    ids = smollm2_tokenizer().encode(text, add_special_tokens=False)
    thought, answer = split_reasoning(text, False)

    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with FakeEngine(ids, tokens_per_step=per_step) as eng:
            async with gateway(eng, reasoning_parser="qwen3") as http:
                return await post(http, "/v1/chat/completions", chat_body(False)), \
                    await post(http, "/v1/chat/completions", chat_body(True))

    whole, chunks = run(main())
    msg = whole["choices"][0]["message"]
    assert (msg.get("reasoning_content"), msg["content"]) == (thought, answer)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    for usage in (whole["usage"], chunks[-1]["usage"]):
        assert usage["completion_tokens_details"]["reasoning_tokens"] == reference_count(ids)


# Outputs of a block the prompt opened, closed in spellings its ids alone miss (` </`, `>.`,
# `.</`, `>"`, `>,`).
CLOSINGS = ["I think so </think> Paris is the capital.", "hmm, so</think>.\n\nParis.",
            "So.</think>\"Paris\"", "(x)</think>, then", "so </think>)"]


@pytest.mark.parametrize("text", CLOSINGS)
def test_the_engine_sees_the_reasoning_end_where_the_text_does_by_the_spellings_the_gateway_sends(
        text: str) -> None:
    """What the engine's budget matches (ids, no text): the end tag's ids and the spellings a
    budgeted chat request carries, found with the served tokenizer. The reference is the
    tokenizer's decode."""
    tok = smollm2_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)

    async def main() -> list[P.Add]:
        with FakeEngine(ids) as eng:
            async with gateway(eng, reasoning_parser="qwen3") as http:
                await post(http, "/v1/chat/completions",
                           chat_body(False) | {"thinking_token_budget": 8})
                await post(http, "/v1/chat/completions", chat_body(False))
            return eng.adds()

    budgeted, plain = (add.params for add in run(main()))
    assert plain.reasoning_end_spellings == ()  # only a budget reads them
    assert all(CLOSE in tok.decode(list(s)) for s in budgeted.reasoning_end_spellings)
    for end in (thinking.Tag(budgeted.reasoning_end_ids),
                thinking.Tag(budgeted.reasoning_end_ids, budgeted.reasoning_end_spellings)):
        state: int | None = 0
        for k in range(1, len(ids) + 1):
            state = thinking.after(state, ids[:k], 0, thinking.Tag(()), end)
            if state is None:
                break
        assert (k if state is None else None) == (reference_count(ids) if end.spellings else None)
