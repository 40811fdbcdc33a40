"""--reasoning-parser against a real `conveyor serve` (float32, greedy): a tiny random chat model
with a Qwen3/DeepSeek-R1 style chat template whose generation prompt opens `<think>` (so the
model's continuation is reasoning until it writes `</think>`), and `enable_thinking: false` closing
an empty block in the prompt, as Qwen3's. A random model does not write `</think>` by itself: a
regex constraint forces the tag into the output (the tokens around it are the model's); on the
Responses and Messages doors, which take no regex, a JSON schema whose string pattern holds the tag
does. The reference is the tokenizer's full decode of the tokens the offline engine generates for
the same prompt and constraint, split at the tags; through all three doors, with the openai and
anthropic SDKs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import EasyInputMessageParam, ResponseInputParam, ResponseReasoningItem

from tests.conftest import error_body, present
from tests.e2e.sdk import final_response
from tests.e2e.servers import Server, tiny_serve
from tests.fakes import smollm2_tokenizer

pytestmark = pytest.mark.slow
MODEL = "tiny-think"
TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
ASK_TEXT = "Why is the sky blue?"
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": ASK_TEXT}]
# the same turn, for anthropic
CLAUDE_ASK: list[MessageParam] = [{"role": "user", "content": ASK_TEXT}]
THINK_THEN_ANSWER = (
    r"[a-z ]{4,24}</think>[a-z ]{4,24}"  # forced by the grammar: the tag, not the words
)


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("reasoning")
    (folder / "think.jinja").write_text(TEMPLATE)
    with Server(
        tiny_serve(tiny_chat_model, "--served-model-name", MODEL, "--chat-template",
                   str(folder / "think.jinja"),
                   "--reasoning-parser", "qwen3", "--dtype", "float32"),
        log_path=folder / "server.log",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_chat_model: Path) -> Any:
    """(prompt ids, regex or None, max_tokens, JSON schema or None) -> the tokenizer's full decode
    of the offline engine's greedy output."""
    import torch

    from engine.offline import LLM
    from shared.constraints import Constraint, json_schema
    from shared.sampling import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(str(tiny_chat_model), num_threads=1, kv_cache_memory="16MiB", dtype="float32")
    tok = smollm2_tokenizer()

    def generate(ids: list[int], regex: str | None, max_tokens: int, schema: Any = None) -> str:
        constraint = Constraint("regex", regex) if regex else None
        constraint = json_schema(schema) if schema else constraint
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)
        out = llm.generate([ids], params, use_tqdm=False)
        return tok.decode(out[0].token_ids, skip_special_tokens=True)

    return generate


def prompt_ids(server: Server, kwargs: dict[str, Any] | None = None) -> list[int]:
    import httpx

    body: dict[str, Any] = {"messages": ASK, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, str]:
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize(
    ("kwargs", "regex", "want"),
    [
        (None, THINK_THEN_ANSWER, "split"),  # the prompt opened <think>; the model closes it
        (None, None, "all reasoning"),  # never closed: cut by max_tokens, all reasoning
        ({"enable_thinking": False}, None, "all content"),  # the prompt closed an empty block
        (
            {"enable_thinking": False},
            r"<think>[a-z ]{4,24}</think>[a-z ]{4,24}",
            "split",
        ),  # the model opens one
    ],
)
def test_reasoning_and_content_are_split_streamed_and_not(
    client: openai.OpenAI,
    server: Server,
    reference: Any,
    kwargs: dict | None,
    regex: str | None,
    want: str,
) -> None:
    full = reference(prompt_ids(server, kwargs), regex, 24)
    extra: dict[str, Any] = {"chat_template_kwargs": kwargs} if kwargs else {}
    if regex:
        extra["structured_outputs"] = {"regex": regex}
    kw: dict[str, Any] = dict(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                              extra_body=extra)
    msg = client.chat.completions.create(**kw).choices[0].message
    if want == "split":
        thought, answer = full.removeprefix("<think>").split("</think>")
        assert thought.strip() and answer.strip() and "think>" not in thought + answer
    else:
        thought, answer = (full, "") if want == "all reasoning" else ("", full)
    assert (msg.reasoning_content or "", msg.content or "") == (thought, answer)
    assert streamed(client, **kw) == (thought, answer)


def test_include_reasoning_false_and_unknown_template_kwargs(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    msg = client.chat.completions.create(
        **kw,
        extra_body={"include_reasoning": False, "structured_outputs": {"regex": THINK_THEN_ANSWER}},
    )
    assert (
        msg.choices[0].message.content
        and getattr(msg.choices[0].message, "reasoning_content", None) is None
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"enable_thinkin": False}}
        )
    assert error_body(e.value.body)["param"] == "chat_template_kwargs.enable_thinkin"


# Responses' text.format and Messages' output_config.format take a JSON schema: its string pattern
# forces the tag, so the output `"words</think>words"` splits at it (quotes included).
SPLIT_SCHEMA = {"type": "string", "pattern": "^[a-z ]{4,24}</think>[a-z ]{4,24}$"}
RESPONSES_CASES = [
    ({}, None, None, "all reasoning"),  # the prompt opened <think>; cut by max_output_tokens
    (
        {"text": {"format": {"type": "json_schema", "name": "s", "schema": SPLIT_SCHEMA}}},
        None,
        SPLIT_SCHEMA,
        "split",
    ),
    ({"reasoning": {"effort": "none"}}, {"enable_thinking": False}, None, "all content"),
]


def expected(full: str, want: str) -> tuple[str, str]:
    """The reference text split as the parser must split it."""
    if want == "split":
        thought, answer = full.split("</think>")
        assert thought.strip() and answer.strip() and "think>" not in thought + answer
        return thought, answer
    return (full, "") if want == "all reasoning" else ("", full)


def without_ids(items: list[Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k != "id"}
            for item in items]


@pytest.mark.parametrize(("extra", "kwargs", "schema", "want"), RESPONSES_CASES)
def test_responses_reasoning_item_streamed_and_not(
    client: openai.OpenAI,
    server: Server,
    reference: Any,
    extra: dict[str, Any],
    kwargs: dict[str, Any] | None,
    schema: Any,
    want: str,
) -> None:
    thought, answer = expected(reference(prompt_ids(server, kwargs), None, 48, schema), want)
    kw: dict[str, Any] = dict(model=MODEL, input=ASK_TEXT, max_output_tokens=48, temperature=0,
                              **extra)
    r = client.responses.create(**kw)
    kinds = ["reasoning"] * bool(thought) + ["message"] * bool(answer)
    assert [o.type for o in r.output] == kinds
    if thought:
        item = r.output[0]
        assert item.id.startswith("rs_") and item.summary == []
        assert [(c.type, c.text) for c in item.content] == [("reasoning_text", thought)]
    assert r.output_text == answer
    assert r.reasoning.effort == (extra.get("reasoning") or {}).get("effort")

    with client.responses.stream(**kw) as stream:
        events = list(stream)
    # the helper's get_final_response wants response.completed; a cut output ends incomplete
    final = stream.get_final_response() if r.status == "completed" else final_response(events)
    assert events[-1].type == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [e.text for e in events
            if e.type == "response.reasoning_text.done"] == [thought] * bool(thought)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == kinds
    assert without_ids(final.output) == without_ids(r.output)


def transformers_prompt_len(messages: Sequence[Mapping[str, Any]]) -> int:
    """The prompt the template renders, by transformers: the reference for what the model reads."""
    tok = smollm2_tokenizer()
    text = tok.apply_chat_template([dict(m) for m in messages], chat_template=TEMPLATE,
                                   add_generation_prompt=True, tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_previous_response_id_and_sent_back_reasoning_items_are_not_assistant_text(
    client: openai.OpenAI,
) -> None:
    """A response whose output is reasoning continues with an empty assistant turn (this template
    shows no reasoning_content), whether chained by id or by sending its items back."""
    first = client.responses.create(model=MODEL, input=ASK_TEXT, max_output_tokens=8, temperature=0)
    reasoning = first.output[0]
    assert [o.type for o in first.output] == ["reasoning"] and isinstance(reasoning,
                                                                          ResponseReasoningItem)
    assert present(reasoning.content)[0].text
    ask: EasyInputMessageParam = {"role": "user", "content": ASK_TEXT}
    empty: EasyInputMessageParam = {"role": "assistant", "content": ""}
    again: EasyInputMessageParam = {"role": "user", "content": "And at night?"}
    want = transformers_prompt_len([ask, empty, again])
    chained = client.responses.create(model=MODEL, input=[again], previous_response_id=first.id,
                                      max_output_tokens=4, temperature=0)
    # the item as a client sends it back: its JSON, not the SDK's param type
    item: Any = reasoning.model_dump(exclude_none=True)
    sent_back = client.responses.create(
        model=MODEL, input=[ask, item, empty, again], max_output_tokens=4, temperature=0,
    )
    assert present(chained.usage).input_tokens == present(sent_back.usage).input_tokens == want
    with pytest.raises(openai.BadRequestError) as e:  # reasoning must lead to an assistant item
        bad: ResponseInputParam = [ask, item, again]
        client.responses.create(model=MODEL, input=bad, max_output_tokens=4)
    assert error_body(e.value.body)["param"] == "input[1]"


@pytest.mark.parametrize(
    ("reasoning", "param"),
    [
        ({"effort": "high"}, "reasoning.effort"),
        ({"summary": "auto"}, "reasoning.summary"),
        ({"effort": "none", "colour": 1}, "reasoning.colour"),
    ],
)
def test_responses_reasoning_options_that_cannot_be_honoured_are_400s(
    client: openai.OpenAI, reasoning: Any, param: str  # Any: some lie outside the SDK's own type
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=ASK_TEXT, max_output_tokens=4,
                                reasoning=reasoning)
    assert error_body(e.value.body)["param"] == param


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


MESSAGES_CASES = [
    ({}, None, None, "all reasoning"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SPLIT_SCHEMA}}}, None,
     SPLIT_SCHEMA, "split"),
    ({"thinking": {"type": "disabled"}}, {"enable_thinking": False}, None, "all content"),
    ({"thinking": {"type": "adaptive"}}, None, None, "all reasoning"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, None, None, "all reasoning"),
]


@pytest.mark.parametrize(("extra", "kwargs", "schema", "want"), MESSAGES_CASES)
def test_messages_thinking_block_streamed_and_not(
    claude: anthropic.Anthropic,
    server: Server,
    reference: Any,
    extra: dict[str, Any],
    kwargs: dict[str, Any] | None,
    schema: Any,
    want: str,
) -> None:
    thought, answer = expected(reference(prompt_ids(server, kwargs), None, 48, schema), want)
    body = {k: v for k, v in extra.items() if k != "thinking"} | {"temperature": 0}
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=48, messages=CLAUDE_ASK, extra_body=body,
                              **({"thinking": extra["thinking"]} if "thinking" in extra else {}))
    msg = claude.messages.create(**kw)
    blocks = [("thinking", thought)] * bool(thought) + [("text", answer)] * bool(answer)
    assert [(b.type, b.thinking if b.type == "thinking" else b.text) for b in msg.content] == blocks
    assert all(b.signature == "" for b in msg.content if b.type == "thinking")
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=lambda d: d != "thinking_delta")  # thinking first
    assert final.model_dump(exclude={"id"}) == msg.model_dump(exclude={"id"})


@pytest.mark.parametrize(
    ("thinking", "param"),
    [
        ({"type": "enabled", "budget_tokens": 100}, "thinking.budget_tokens"),  # < 1024
        ({"type": "adaptive", "display": "omitted"}, "thinking.display"),
        ({"type": "sometimes"}, "thinking.type"),
    ],
)
def test_messages_thinking_that_cannot_be_honoured_is_a_400(
    # Any: some lie outside the SDK's own type
    claude: anthropic.Anthropic, thinking: Any, param: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4096, messages=CLAUDE_ASK, thinking=thinking)
    error = error_body(e.value.body)["error"]
    assert error["type"] == "invalid_request_error"
    assert param.split(".")[-1] in error["message"]


def test_thinking_blocks_sent_back_are_not_assistant_text(claude: anthropic.Anthropic) -> None:
    turn: MessageParam = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "the sun is low", "signature": ""},
        {"type": "text", "text": "Rayleigh."},
    ]}
    again: MessageParam = {"role": "user", "content": "And at night?"}
    count = claude.messages.count_tokens(model=MODEL, messages=[*CLAUDE_ASK, turn, again])
    want = transformers_prompt_len([*CLAUDE_ASK, {"role": "assistant", "content": "Rayleigh."},
                                    again])
    assert count.input_tokens == want
