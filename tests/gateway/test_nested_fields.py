"""Unknown keys at any depth of any route's body are a 400 naming their whole path (OpenAI's error
shape), against a fake engine; and the keys OpenAI clients send back routinely still pass."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes import FakeEngine
from tests.gateway.test_fields import CHAT, COMPLETIONS, post, refused
from tests.gateway.test_routes import gateway, run

HI = {"role": "user", "content": "hi"}
TOOL: dict[str, Any] = {"type": "function",
                        "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
FORMAT: dict[str, Any] = {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "object"}}}


def _chat(**extra: Any) -> dict[str, Any]:
    return {**CHAT[1], **extra}


CHAT_CASES = [  # (body, the path the 400 must name)
    (_chat(messages=[HI, {**HI, "foo": 1}]), "messages[1].foo"),
    (
        _chat(messages=[HI, {**HI, "content": [{"type": "text", "text": "x", "foo": 1}]}]),
        "messages[1].content[0].foo",
    ),
    (
        _chat(
            messages=[
                {"role": "assistant", "content": None, "tool_calls": [{**CALL, "foo": 1}]},
                HI,
            ]
        ),
        "messages[0].tool_calls[0].foo",
    ),
    (
        _chat(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [
                        {**CALL, "function": {"name": "f", "arguments": "{}", "foo": 1}}
                    ],
                },
                HI,
            ]
        ),
        "messages[0].tool_calls[0].function.foo",
    ),
    (_chat(tools=[{**TOOL, "foo": 1}]), "tools[0].foo"),
    (
        _chat(tools=[{"type": "function", "function": {"name": "f", "foo": 1}}]),
        "tools[0].function.foo",
    ),
    (
        _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f", "foo": 1}}),
        "tool_choice.function.foo",
    ),
    (
        _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}, "foo": 1}),
        "tool_choice.foo",
    ),
]
BOTH_CASES: list[tuple[dict[str, Any], str]] = [  # the same on both routes
    ({"response_format": {**FORMAT, "foo": 1}}, "response_format.foo"),
    (
        {"response_format": {**FORMAT, "json_schema": {**FORMAT["json_schema"], "foo": 1}}},
        "response_format.json_schema.foo",
    ),
    ({"stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
    ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs.backend"),
]


@pytest.mark.parametrize(("body", "where"), CHAT_CASES + [(_chat(**b), w) for b, w in BOTH_CASES])
def test_chat_names_the_unknown_nested_key(body: dict[str, Any], where: str) -> None:
    err = refused(CHAT[0], body)
    assert err["param"] == where and f"unknown field {where!r}" in err["message"], err


@pytest.mark.parametrize(("body", "where"), BOTH_CASES)
def test_completions_names_the_unknown_nested_key(body: dict[str, Any], where: str) -> None:
    err = refused(COMPLETIONS[0], {**COMPLETIONS[1], **body})
    assert err["param"] == where and f"unknown field {where!r}" in err["message"], err


@pytest.mark.parametrize(
    ("part", "where"),
    [
        ({"type": "image_url", "image_url": {"url": "x"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {}}, "input_audio"),
    ],
)
def test_known_unsupported_parts_say_so(part: dict[str, Any], where: str) -> None:
    err = refused(CHAT[0], _chat(messages=[{"role": "user", "content": [part]}]))
    assert (
        err["param"] == f"messages[0].content[0].{where}" and "not supported" in err["message"]
    ), err


def test_tokenizer_routes_and_websocket_frames_name_unknown_keys() -> None:
    async def main() -> None:
        with FakeEngine(max_model_len=64) as eng:
            async with gateway(eng) as http:
                cases: list[tuple[str, dict[str, Any], str]] = [
                    ("/tokenize", {"prompt": "hi", "foo": 1}, "foo"),
                    ("/tokenize", {"messages": [{**HI, "foo": 1}]}, "messages[0].foo"),
                    (
                        "/tokenize",
                        {
                            "messages": [
                                {
                                    "role": "user",
                                    "content": [{"type": "text", "text": "x", "foo": 1}],
                                }
                            ]
                        },
                        "messages[0].content[0].foo",
                    ),
                    ("/detokenize", {"tokens": [1], "foo": 1}, "foo"),
                ]
                for path, body, where in cases:
                    status, out = await post(http, path, body)
                    assert status == 400 and out["error"]["param"] == where, (path, out)
                    assert f"unknown field {where!r}" in out["error"]["message"]
                status, out = await post(http, "/tokenize", {"prompt": "hi", "model": "other"})
                assert status == 400 and out["error"]["code"] == "model_not_found", out
                ws = await http.ws_connect("/v1/ws")
                for op, body, where in [
                    ("chat.completions", _chat(messages=[{**HI, "foo": 1}]), "messages[0].foo"),
                    (
                        "completions",
                        {**COMPLETIONS[1], "response_format": {"type": "text", "x": 1}},
                        "response_format.x",
                    ),
                ]:
                    await ws.send_json({"op": op, "id": "a", "body": body})
                    frame = await ws.receive_json()
                    assert frame["event"] == "error" and frame["error"]["param"] == where, frame
                await ws.close()
                assert eng.adds() == []

    run(main())


def test_what_openai_clients_send_back_passes() -> None:
    """An SDK message's model_dump (refusal, annotations, audio and function_call null), `name` on
    messages, `strict` on functions and json_schema: all accepted."""
    from openai.types.chat import ChatCompletionMessage

    sdk_message = ChatCompletionMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "annotations": [],
            "tool_calls": [CALL],
        }
    ).model_dump()
    assert {"audio", "function_call", "annotations", "refusal"} <= set(sdk_message)
    body = _chat(
        messages=[
            {**HI, "name": "bob"},
            sdk_message,
            {"role": "tool", "tool_call_id": "call_1", "content": "{}"},
            {"role": "user", "content": [{"type": "text", "text": "and?"}]},
        ],
        tools=[
            {
                "type": "function",
                "function": {**TOOL["function"], "strict": True, "description": "d"},
            }
        ],
        tool_choice="auto",
        stream_options=None,
    )

    async def main() -> None:
        with FakeEngine(max_model_len=512) as eng:
            async with gateway(eng) as http:
                status, out = await post(http, CHAT[0], {**body, "max_tokens": 3})
                assert status == 200, out
                status, out = await post(
                    http, "/tokenize", {"messages": body["messages"], "model": None}
                )
                assert status == 200, out

    run(main())


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"include_reasoning": True},
            "include_reasoning",
        ),  # no --reasoning-parser: a reasoning field is refused
        ({"thinking_token_budget": 64}, "thinking_token_budget"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs.enable_thinking",
        ),  # never read
        (
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
        ),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_reasoning_fields_without_a_parser_and_template_kwargs_the_template_ignores(
    extra: dict[str, Any], param: str
) -> None:
    err = refused(CHAT[0], _chat(**extra))
    assert err["param"] == param, err


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        (
            {"type": "json_schema", "json_schema": FORMAT["json_schema"], "schema": {}},
            "response_format.schema",
        ),
        (
            {"type": "json_object", "json_schema": FORMAT["json_schema"]},
            "response_format.json_schema",
        ),
        ({"type": "text", "schema": {"type": "object"}}, "response_format.schema"),
        ({"type": "json_object", "schema": "{}"}, "response_format.schema"),
    ],
)
def test_a_response_format_key_of_another_type_is_refused(fmt: dict[str, Any], param: str) -> None:
    err = refused(CHAT[0], _chat(response_format=fmt))
    assert err["param"] == param, err
