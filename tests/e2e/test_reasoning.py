"""--reasoning-parser against a real `conveyor serve`: a tiny random chat model with a
Qwen3/DeepSeek-R1 style chat template whose generation prompt opens `<think>` (so the model's
continuation is reasoning until it writes `</think>`), and `enable_thinking: false` closing an empty
block in the prompt, as Qwen3's. A random model does not write `</think>` by itself: a regex
constraint forces the tag into the output (the tokens around it are the model's). The reference is
the tokenizer's full decode of the tokens the offline engine generates for the same prompt and
constraint, split at the tags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

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
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
THINK_THEN_ANSWER = (
    r"[a-z ]{4,24}</think>[a-z ]{4,24}"  # forced by the grammar: the tag, not the words
)


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("reasoning")
    (folder / "think.jinja").write_text(TEMPLATE)
    with Server(
        tiny_serve(tiny_chat_model, "--served-model-name", MODEL, "--chat-template", str(folder / "think.jinja"),
                   "--reasoning-parser", "qwen3"),
        log_path=folder / "server.log",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_chat_model: Path) -> Any:
    """(prompt ids, regex or None, max_tokens) -> the tokenizer's full decode of the offline
    engine's greedy output."""
    import torch

    from engine.offline import LLM
    from shared.constraints import Constraint
    from shared.sampling import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(str(tiny_chat_model), num_threads=1, kv_cache_memory="16MiB")
    tok = smollm2_tokenizer()

    def generate(ids: list[int], regex: str | None, max_tokens: int) -> str:
        extra = {"constraint": Constraint("regex", regex)} if regex else {}
        out = llm.generate(
            [ids], SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra), use_tqdm=False
        )
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
    kw = dict(model=MODEL, messages=ASK, max_tokens=24, temperature=0, extra_body=extra)
    msg = client.chat.completions.create(**kw).choices[0].message
    if want == "split":
        thought, answer = full.removeprefix("<think>").split("</think>")
        assert thought.strip() and answer.strip() and "think>" not in thought + answer
    else:
        thought, answer = (full, "") if want == "all reasoning" else ("", full)
    assert (msg.reasoning_content or "", msg.content or "") == (thought, answer)
    assert streamed(client, **kw) == (thought, answer)


def test_include_reasoning_false_and_unknown_template_kwargs(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
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
    assert e.value.body["param"] == "chat_template_kwargs.enable_thinkin"
