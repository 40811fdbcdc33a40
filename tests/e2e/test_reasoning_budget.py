"""A thinking budget and reasoning_tokens against a real `conveyor serve` (float32, greedy), with
the `anthropic` and `openai` SDKs: the tiny random chat model of tests/e2e/test_reasoning.py with a
context of 2048 (Anthropic's budget_tokens is at least 1024, and max_tokens must be above it to
bind). Its generation prompt opens `<think>` and a random model never writes `</think>`: the forced
tag is what ends the reasoning. The reference is the offline engine's greedy tokens for the same
prompt and budget; reasoning_tokens count the reasoning part's tokens, its tags included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import error_body, present
from tests.e2e.conftest import TINY_CHAT
from tests.e2e.sdk import final_response
from tests.e2e.servers import Server, tiny_serve
from tests.e2e.test_reasoning import ASK, ASK_TEXT, CLAUDE_ASK, TEMPLATE, expected, prompt_ids
from tests.fakes import smollm2_tokenizer

pytestmark = pytest.mark.slow
MODEL = "tiny-think"


@pytest.fixture(scope="module")
def think_model(tmp_path_factory: pytest.TempPathFactory, make_tiny_checkpoint: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("models") / "tiny-think-2k"
    make_tiny_checkpoint(folder, LlamaConfig, LlamaForCausalLM, seed=3,
                         **{**TINY_CHAT, "max_position_embeddings": 2048})
    smollm2_tokenizer().save_pretrained(folder)
    (folder / "think.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(think_model: Path):
    with Server(
        tiny_serve(think_model, "--served-model-name", MODEL, "--chat-template",
                   str(think_model / "think.jinja"),
                   "--reasoning-parser", "qwen3", "--dtype", "float32"),
        log_path=think_model / "server.log",
    ) as srv:
        yield srv


# several tokens in SmolLM2's vocabulary
END = smollm2_tokenizer().encode("</think>", add_special_tokens=False)


@pytest.fixture(scope="module")
def reference(think_model: Path) -> Any:
    """(prompt ids, max_tokens, budget or None) -> the offline engine's greedy output ids."""
    import torch

    from engine.offline import LLM
    from shared.sampling import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(str(think_model), num_threads=1, kv_cache_memory="16MiB", dtype="float32")

    def generate(ids: list[int], max_tokens: int, budget: int | None) -> list[int]:
        extra = {} if budget is None else {"thinking_token_budget": budget,
                                           "reasoning_end_ids": END}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)
        return list(llm.generate([ids], params, use_tqdm=False)[0].token_ids)

    return generate


def text(ids: list[int]) -> str:
    return smollm2_tokenizer().decode(ids, skip_special_tokens=True)


def test_anthropic_budget_tokens_cut_the_thinking_and_the_answer_follows(server: Server,
                                                                         reference: Any) -> None:
    free = reference(prompt_ids(server), 1100, None)
    assert "</think>" not in text(free)  # left alone, the model reasons to max_tokens
    ids = reference(prompt_ids(server), 1100, 1024)
    assert ids[:1024] == free[:1024] and ids[1024:1024 + len(END)] == END
    thought, answer = expected(text(ids), "split")
    # exactly the budget's 1024 tokens, then the answer
    assert thought == text(ids[:1024]) and answer.strip()
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=1100, messages=CLAUDE_ASK,
                              extra_body={"temperature": 0},
                              thinking={"type": "enabled", "budget_tokens": 1024})
    msg = claude.messages.create(**kw)
    assert [(b.type, b.thinking if b.type == "thinking" else b.text) for b in msg.content] == [
        ("thinking", thought), ("text", answer)]
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 1100
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    dump = {"content", "stop_reason"}  # not usage: the stream's prompt was a prefix-cache hit
    assert final.model_dump(include=dump) == msg.model_dump(include=dump)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize(("extra", "reasoning_tokens"), [
    ({"thinking_token_budget": 8}, 8 + len(END)),  # vLLM's field: 8 tokens, then the forced tag
    ({}, 24),  # the prompt opened <think> and nothing closes it: all of the output
    ({"chat_template_kwargs": {"enable_thinking": False}}, 0),  # the prompt closed an empty block
])
def test_chat_usage_counts_reasoning_tokens_streamed_and_not(
    client: openai.OpenAI, server: Server, reference: Any, extra: dict[str, Any],
    reasoning_tokens: int,
) -> None:
    budget = extra.get("thinking_token_budget")
    ids = reference(prompt_ids(server, extra.get("chat_template_kwargs")), 24, budget)
    kw: dict[str, Any] = dict(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                              extra_body=extra)
    out = client.chat.completions.create(**kw)
    assert out.usage.completion_tokens == 24
    assert out.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    msg = out.choices[0].message
    if budget is not None:
        assert ids[budget:budget + len(END)] == END
        assert (msg.reasoning_content, msg.content) == expected(text(ids), "split")
        assert msg.reasoning_content == text(ids[:budget])
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    use = chunks[-1].usage  # prompt_tokens_details differ: the prompt is cached now
    assert use.completion_tokens == 24
    assert use.completion_tokens_details == out.usage.completion_tokens_details


@pytest.mark.parametrize(("extra", "all_reasoning"),
                         [({}, True), ({"reasoning": {"effort": "none"}}, False)])
def test_responses_usage_counts_reasoning_tokens(client: openai.OpenAI, extra: dict[str, Any],
                                                 all_reasoning: bool) -> None:
    kw: dict[str, Any] = dict(model=MODEL, input=ASK_TEXT, max_output_tokens=16, temperature=0,
                              **extra)
    usage = present(client.responses.create(**kw).usage)
    assert usage.output_tokens == 16
    assert usage.output_tokens_details.reasoning_tokens == (16 if all_reasoning else 0)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    # input_tokens_details differ: the prompt is cached now
    use = present(final_response(events).usage)
    assert (use.output_tokens, use.output_tokens_details) == (16, usage.output_tokens_details)


FORMAT = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string"}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": "64"}, "thinking_token_budget"),
    # the grammar decides
    ({"thinking_token_budget": 8, "response_format": FORMAT}, "thinking_token_budget"),
])
def test_chat_budgets_that_cannot_be_honoured_are_400s(client: openai.OpenAI, extra: dict[str, Any],
                                                       param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, extra_body=extra)
    assert error_body(e.value.body)["param"] == param


def test_messages_budget_with_an_output_format_is_a_400(server: Server) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        string_schema = {"type": "json_schema", "schema": {"type": "string"}}
        claude.messages.create(model=MODEL, max_tokens=1100, messages=CLAUDE_ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024},
                               extra_body={"output_config": {"format": string_schema}})
    assert "budget_tokens" in error_body(e.value.body)["error"]["message"]
