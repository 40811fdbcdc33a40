"""The official `openai` package as the client of a real `conveyor serve` (tiny random chat model):
every call shape we support, and OpenAI-shaped errors for what we refuse."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import error_body, present
from tests.e2e.servers import Server

pytestmark = pytest.mark.slow
KEY = "sk-e2e-test"
CHAT = [{"role": "user", "content": "Write a story."}]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("openai") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "64MiB", "--max-concurrent-requests", "6"],
                env={"CONVEYOR_API_KEY": KEY}, log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny-chat"]


def test_completion_and_its_stream_agree(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", prompt="Once upon a time", max_tokens=12,
                              temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    choice = whole.choices[0]
    assert whole.object == "text_completion"
    assert choice.finish_reason == "length"
    assert choice.index == 0
    usage = present(whole.usage)
    assert usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 12
    parts = list(client.completions.create(**kw, stream=True))
    assert all(p.object == "text_completion" and p.id == parts[0].id for p in parts)
    assert "".join(p.choices[0].text for p in parts) == choice.text
    assert parts[-1].choices[0].finish_reason == "length"
    assert all(p.usage is None for p in parts)  # no usage unless stream_options asks for it


def test_chat_and_its_stream_agree_with_usage(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", messages=CHAT, max_tokens=10, temperature=0,
                              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.object == "chat.completion"
    assert msg.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    parts = list(client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == msg.content
    assert parts[-2].choices[0].finish_reason == "length"
    assert parts[-1].choices == [] and parts[-1].usage is not None
    u, w = parts[-1].usage, whole.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (w.prompt_tokens, 10,
                                                                      w.prompt_tokens + 10)
    # The same prompt twice: the second run finds its full blocks in the prefix cache.
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens > 0


def test_max_completion_tokens_and_seeded_sampling(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", messages=CHAT, max_completion_tokens=7,
                              temperature=1.0, seed=42, extra_body={"ignore_eos": True})
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert a.usage.completion_tokens == 7
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_strings(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", prompt="The weather today", max_tokens=16,
                              temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = client.completions.create(**kw, stop=[stop, "never-appears"])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in streamed) == text[:text.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_async_client_streams_concurrently(server: Server) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)

        async def one(i: int) -> str:
            stream = await aclient.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": f"Number {i}"}],
                max_tokens=8, stream=True,
                temperature=0)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        try:
            return await asyncio.gather(*[one(i) for i in range(4)])
        finally:
            await aclient.close()

    texts = asyncio.run(main())
    assert len(texts) == 4 and all(isinstance(t, str) and t for t in texts)


@pytest.mark.parametrize("call, param, needle", [
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", max_tokens=0), "max_tokens",
     "echo=true"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", suffix="end"), "suffix",
     "not supported"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", logprobs=21), "logprobs",
     "[0, 20]"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=CHAT, top_logprobs=2),
     "top_logprobs", "logprobs=true"),
    (lambda c: c.completions.create(model="gpt-4", prompt="hi"), "model", "does not exist"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", max_tokens=-1), "max_tokens",
     "in [1, "),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=CHAT, temperature=-1),
     "temperature", "in [0, "),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi " * 1100), "prompt",
     "maximum context length"),
], ids=["max-tokens-0-without-echo", "suffix", "logprobs-range", "top_logprobs-alone",
        "unknown-model", "max-tokens",
        "temperature", "too-long"])
def test_refusals_are_openai_bad_request_errors(client: openai.OpenAI,
                                                call: Callable[[openai.OpenAI], object], param: str,
                                                needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call(client)
    err = info.value
    assert err.status_code == 400 and err.type == "invalid_request_error" and err.param == param
    assert needle in err.message and needle in error_body(err.body)["message"]


def test_wrong_key_is_authentication_error(server: Server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401 and info.value.type == "authentication_error"


def test_full_server_is_rate_limit_error(client: openai.OpenAI) -> None:
    """--max-concurrent-requests 6: six open streams, the seventh request gets 429 with
    Retry-After."""
    streams = [client.completions.create(model="tiny-chat", prompt="hi", max_tokens=800,
                                         stream=True, extra_body={"ignore_eos": True})
               for _ in range(6)]
    try:
        for s in streams:
            next(iter(s))
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny-chat", prompt="hi", max_tokens=2)
        assert info.value.status_code == 429
        assert int(info.value.response.headers["Retry-After"]) >= 1
        assert "--max-concurrent-requests" in info.value.message
    finally:
        for s in streams:
            s.close()
    for _ in range(50):  # the closed streams free their places: a normal request is served again
        try:
            done = client.completions.create(model="tiny-chat", prompt="hi", max_tokens=2)
            assert present(done.usage).completion_tokens >= 1
            return
        except openai.RateLimitError:
            time.sleep(0.1)
    pytest.fail("still 429 after the streams were closed")
