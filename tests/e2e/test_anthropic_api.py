"""Anthropic's Messages API through the official `anthropic` SDK against a real `conveyor serve`
with an API key (the SDK sends it as x-api-key). Tiny random chat model, float32, greedy: the
reference for every text is the chat-completions route given the same conversation."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import error_body
from tests.e2e.sdk import text_of, tool_use_of
from tests.e2e.servers import Server, tiny_serve

pytestmark = pytest.mark.slow
MODEL = "tiny-chat"
KEY = "sk-test"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    }
]
GREEDY = {"temperature": 0}  # the SDK no longer has the parameter; the API still takes it
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("anthropic") / "server.log"
    with Server(
        tiny_serve(tiny_chat_model, "--dtype", "float32", "--tool-call-parser", "hermes",
                   "--api-key", KEY),
        log_path=log,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def chat_text(oai: openai.OpenAI, messages: list[Any], max_tokens: int, **kw: Any) -> str:
    out = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )
    return out.choices[0].message.content or ""


def test_create_and_stream_give_the_chat_routes_text(
    client: anthropic.Anthropic, oai: openai.OpenAI
) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL,
        max_tokens=12,
        extra_body=GREEDY,
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
    )
    msg = client.messages.create(**kw)
    want = chat_text(
        oai,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a story."},
        ],
        12,
    )
    assert [b.type for b in msg.content] == ["text"] and text_of(msg.content[0]) == want and want
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None and msg.role == "assistant"
    assert msg.usage.output_tokens == 12 and msg.usage.input_tokens > 0 and msg.model == MODEL
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]  # the SDK's iterator skips pings
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert text_of(final.content[0]) == want and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12


def test_stop_sequences_end_the_text_and_are_named(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=ASK)
    text = text_of(client.messages.create(**kw).content[0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    msg = client.messages.create(**kw, stop_sequences=["zzzz-never", stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert text_of(msg.content[0]) == text[: text.index(stop)]


def test_tool_use_round_trip(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    choice: Any = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    msg = client.messages.create(
        model=MODEL,
        max_tokens=100,
        extra_body=GREEDY,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
    )
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    use = tool_use_of(msg.content[0])
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(
        model=MODEL,
        max_tokens=100,
        extra_body=GREEDY,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
    ) as stream:
        partial = "".join(
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    assert json.loads(partial) == tool_use_of(final.content[0]).input == use.input
    follow = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 21}'}],
        },
    ]
    answer = client.messages.create(
        model=MODEL, max_tokens=8, extra_body=GREEDY, messages=follow, tools=TOOLS
    )
    want = chat_text(
        oai,
        [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {
                            "name": use.name,
                            "arguments": json.dumps(use.input, ensure_ascii=False),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": '{"temp": 21}'},
        ],
        8,
        tools=CHAT_TOOLS,
    )
    assert text_of(answer.content[0]) == want and answer.stop_reason == "max_tokens"


def test_output_config_format_is_enforced(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model=MODEL,
        max_tokens=60,
        extra_body=GREEDY,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
    )
    assert msg.stop_reason == "end_turn", msg.content
    jsonschema.validate(json.loads(text_of(msg.content[0])), WEATHER)


def test_count_tokens_is_the_prompt_the_model_reads(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(model=MODEL, system="Be brief.", messages=ASK, tools=TOOLS)
    counted = client.messages.count_tokens(**kw).input_tokens
    used = client.messages.create(**kw, max_tokens=1).usage
    assert counted == used.input_tokens + used.cache_read_input_tokens > 10


def _post(server: Server, body: dict[str, Any], key: str = KEY) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"{server.url}/v1/messages",
        data=json.dumps(body).encode(),
        headers={"x-api-key": key, "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_errors_are_in_anthropics_shape(server: Server, client: anthropic.Anthropic) -> None:
    status, body = _post(server, {"model": MODEL, "messages": ASK})
    assert (
        status == 400
        and body["type"] == "error"
        and body["error"]["type"] == "invalid_request_error"
    )
    assert "max_tokens" in body["error"]["message"]
    status, body = _post(server, {"model": MODEL, "messages": ASK, "max_tokens": 4}, key="wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post(
            "/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": ASK}
        )
    assert e.value.status_code == 400
    assert error_body(e.value.body)["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.post("/v1/messages/nope", cast_to=anthropic.types.Message, body={})


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({"foo": 1}, "foo"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}
                ]
            },
            "messages[0].content[0].bogus",
        ),
        ({"messages": [{"role": "user", "content": "x", "name": "me"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"tools": [{**TOOLS[0], "strict": True}]}, "tools[0].strict"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "any", "x": 1}}, "tool_choice.x"),
        ({"metadata": {"user_id": "u", "tier": "gold"}}, "metadata.tier"),
        (
            {
                "system": [
                    {"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "k": 1}}
                ]
            },
            "system[0].cache_control.k",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"temperature": 1.5}, "temperature"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": WEATHER, "x": 1}}},
            "output_config.format.x",
        ),
        ({"messages": [*ASK, {"role": "assistant", "content": "Prefill"}]}, "messages[1]"),
    ],
)
def test_unknown_and_unsupported_fields_are_400s_that_name_them(
    server: Server, extra: dict, path: str
) -> None:
    status, body = _post(server, {"model": MODEL, "max_tokens": 4, "messages": ASK, **extra})
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert path in body["error"]["message"], body


def test_cache_control_is_accepted(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model=MODEL,
        max_tokens=2,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=ASK,
    )
    assert msg.usage.output_tokens == 2
