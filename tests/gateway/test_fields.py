"""Every OpenAI field is honoured or refused, against a fake engine: unknown and unsupported fields
are a 400 naming them, accepted ones are type-checked, informational ones pass, and `priority`
reaches the engine's ADD on both routes and the WebSocket."""
from __future__ import annotations

from typing import Any

import pytest

from gateway.request_fields import HONOURED, UNSUPPORTED
from tests.fakes import FakeEngine
from tests.gateway.test_routes import gateway, run

CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
COMPLETIONS = ("/v1/completions", {"prompt": "hi", "max_tokens": 3})
BOTH = [CHAT, COMPLETIONS]
# OpenAI's request schemas (chat/completions, completions) as of 2025: each field is in exactly one
# of the gateway's tables, so a field added there and forgotten here shows up.
OPENAI_CHAT = {"messages", "model", "audio", "frequency_penalty", "function_call", "functions",
               "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
               "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
               "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier",
               "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
               "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
               "web_search_options"}
OPENAI_COMPLETIONS = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias",
                      "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
                      "stream_options", "suffix", "temperature", "top_p", "user"}


async def post(http: Any, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await http.post(path, json=body)
    return resp.status, await resp.json()


def refused(path: str, body: dict[str, Any]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        with FakeEngine(max_model_len=64) as eng:
            async with gateway(eng) as http:
                status, out = await post(http, path, body)
                assert status == 400, out
                assert eng.adds() == []  # refused at the door: the engine never saw it
                return out["error"]
    err: dict[str, Any] = run(main())
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize(("path", "base"), BOTH)
@pytest.mark.parametrize("field",
                         ["max_token", "temprature", "foo", "stream_option", "", "prority"])
def test_unknown_field_is_named(path: str, base: dict[str, Any], field: str) -> None:
    err = refused(path, {**base, field: 1})
    assert err["param"] == field and f"unknown field {field!r}" in err["message"]


@pytest.mark.parametrize(("path", "base"), BOTH)
@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "alloy"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("web_search_options", {}), ("store", True), ("service_tier", "flex"),
])
def test_unsupported_openai_field_is_named(path: str, base: dict[str, Any], field: str,
                                           value: Any) -> None:
    err = refused(path, {**base, field: value})
    assert err["param"] == field and "not supported" in err["message"], err


def test_tools_are_a_chat_field() -> None:
    err = refused(*COMPLETIONS[:1],
                  {**COMPLETIONS[1], "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert err["param"] == "tools" and "/v1/chat/completions" in err["message"]


def test_the_tables_cover_openais_request_schemas() -> None:
    from gateway.request_fields import INFORMATIONAL

    for chat, openai in ((True, OPENAI_CHAT), (False, OPENAI_COMPLETIONS)):
        known = HONOURED[chat] | set(INFORMATIONAL) | set(UNSUPPORTED)
        assert openai <= known, openai - known


@pytest.mark.parametrize(("path", "base"), BOTH)
@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "0.5"), ("temperature", True), ("top_p", [1]), ("top_k", 2.5), ("min_p", "0"),
    ("seed", 1.5), ("seed", "1"), ("stop", 5), ("stop", {"a": 1}), ("stop", [1]),
    ("stop_token_ids", "1"),
    ("ignore_eos", "false"), ("ignore_eos", 0), ("min_tokens", 1.0), ("presence_penalty", "1"),
    ("frequency_penalty", "x"), ("repetition_penalty", False), ("logit_bias", [1]),
    ("logit_bias", {"x": 1}), ("speculative", "no"), ("stream", "true"), ("stream", 1),
    ("stream_options", []), ("n", 1.0), ("n", True), ("use_beam_search", "yes"), ("priority", 1.5),
    ("priority", "1"), ("priority", True), ("model", 5), ("max_tokens", "3"), ("max_tokens", 3.0),
    ("user", 5), ("metadata", "x"), ("length_penalty", "1"), ("early_stopping", 1),
])
def test_wrong_type_is_named(path: str, base: dict[str, Any], field: str, value: Any) -> None:
    err = refused(path, {**base, field: value})
    assert err["param"] == field, err


@pytest.mark.parametrize(("path", "body", "param"), [
    (*COMPLETIONS, "echo"), (*CHAT, "echo"), (*CHAT, "suffix"), (*CHAT, "prompt"),
    (*COMPLETIONS, "messages"),
    (*COMPLETIONS, "max_completion_tokens"),
])
def test_the_other_endpoints_fields(path: str, body: dict[str, Any], param: str) -> None:
    assert refused(path, {**body, param: 1})["param"] == param


@pytest.mark.parametrize(("path", "base"), BOTH)
def test_stream_options_are_checked(path: str, base: dict[str, Any]) -> None:
    err = refused(path, {**base, "stream": True,
                         "stream_options": {"continuous_usage_stats": True}})
    assert err["param"] == "stream_options.continuous_usage_stats"
    assert "continuous_usage_stats" in err["message"]
    err = refused(path, {**base, "stream": True, "stream_options": {"include_usage": "yes"}})
    assert err["param"] == "stream_options.include_usage"


@pytest.mark.parametrize(("path", "base"), BOTH)
@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 0.7), ("length_penalty", 1000), ("top_p", 0.5), ("presence_penalty", 1),
    ("logit_bias", {"5": 1}), ("min_p", 0.1), ("top_k", 3),
])
def test_beam_search_refuses_what_it_would_ignore(path: str, base: dict[str, Any], field: str,
                                                  value: Any) -> None:
    err = refused(path, {**base, "use_beam_search": True, "beam_width": 2, field: value})
    assert err["param"] == field, err


@pytest.mark.parametrize(("path", "base"), BOTH)
def test_informational_and_null_fields_are_accepted_and_priority_reaches_the_engine(
        path: str, base: dict[str, Any]) -> None:
    extra = {"user": "u-1", "metadata": {"k": "v"}, "safety_identifier": "s",
             "prompt_cache_key": "c", "tools": None, "response_format": None, "store": False,
             "service_tier": "auto", "parallel_tool_calls": True, "stream_options": None,
             "seed": None, "stop": None}

    async def main() -> list[int]:
        with FakeEngine(max_model_len=64) as eng:
            async with gateway(eng) as http:
                for priority in (None, -3, 7):
                    body = {**base, **extra} | ({} if priority is None else {"priority": priority})
                    status, out = await post(http, path, body)
                    assert status == 200, out
                ws = await http.ws_connect("/v1/ws")
                op = "chat.completions" if "messages" in base else "completions"
                await ws.send_json({"op": op, "id": "a", "body": {**base, "priority": 5}})
                while (await ws.receive_json())["event"] != "done":
                    pass
                await ws.send_json({"op": op, "id": "b", "body": base, "extra": 1})
                frame = await ws.receive_json()
                assert frame["event"] == "error" and frame["error"]["param"] == "extra", frame
                await ws.send_json({"op": op, "id": "c", "body": {**base, "tools": []}})
                frame = await ws.receive_json()
                assert frame["event"] == "error" and frame["error"]["param"] == "tools", frame
                await ws.close()
                return [a.priority for a in eng.adds()]
    assert run(main()) == [0, -3, 7, 5]
