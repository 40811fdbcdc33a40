"""Structured output and tool calling through the official `openai` client against a real `conveyor
serve` (tiny random chat model with SmolLM2's tokenizer: the grammar, not the weights, makes outputs
valid). Outputs are checked with `jsonschema`, pydantic (the SDK's `parse`) and `re.fullmatch`."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import BaseModel, Field

from tests.e2e.servers import Server

pytestmark = pytest.mark.slow
MODEL = "tiny-chat"
ASK: list[ChatCompletionMessageParam] = [{"role": "user",
                                          "content": "What is the weather in Paris?"}]
WEATHER: dict[str, object] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME: dict[str, object] = {"type": "object",
                           "properties": {"zone": {"type": "string", "maxLength": 6}},
                           "required": ["zone"]}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function",
     "function": {"name": "get_weather", "description": "Weather in a city",
                  "parameters": WEATHER}},
    {"type": "function",
     "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "64MiB", "--tool-call-parser", "hermes"],
                log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_json_schema_response_format_validates_and_streams_the_same_text(
        client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    kw: dict[str, Any] = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                              response_format=fmt)
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(**kw, stream=True) if c.choices)
    assert streamed == text
    for seed in range(3):  # sampled, and on /v1/completions
        out = client.completions.create(model=MODEL, prompt="A person:", max_tokens=80,
                                        temperature=1.0, seed=seed,
                                        extra_body={"response_format": fmt})
        jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=60, temperature=0.7,
                                         seed=1, response_format=Pet)
    pet = done.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.legs <= 8


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_regex": r"[a-z]{3}-\d{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    ({"structured_outputs": {"regex": r"(yes|no), [0-9]"}},
     lambda t: re.fullmatch(r"(yes|no), [0-9]", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'root ::= "(" [1-9] ("+" [1-9])* ")"'},
     lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ({"structured_outputs": {"json": PERSON}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_vllm_spellings(client: openai.OpenAI, extra: dict, check) -> None:
    out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=1.0,
                                    seed=7, extra_body=extra)
    assert check(out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
    {"guided_regex": "a(b"},
    {"guided_grammar": "root ::= undefined_rule"},
    {"guided_regex": "a", "guided_choice": ["a"]},
    {"response_format": {"type": "xml"}},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
])
def test_invalid_constraints_are_400_and_the_server_keeps_serving(client: openai.OpenAI,
                                                                  extra: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    assert e.value.status_code == 400 and e.value.message
    assert client.chat.completions.create(model=MODEL, messages=ASK,
                                          max_tokens=3).choices[0].message.content


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice",
                         ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_required_and_named_give_valid_calls(client: openai.OpenAI, choice) -> None:
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    kw: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                              max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kw, parallel_tool_calls=False)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls", msg
    _check_calls(msg.tool_calls, names)
    assert len(msg.tool_calls) == 1  # parallel_tool_calls=False: one call
    # streamed: the name comes first, then the arguments; the joined call equals the whole one
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**kw, parallel_tool_calls=False, stream=True):
        if not chunk.choices:
            continue
        reasons.append(chunk.choices[0].finish_reason)
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function.name:
                assert c["name"] is None and not c["arguments"]  # the name first
                c["name"] = d.function.name
            c["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]
    # the follow-up: the assistant's call and the tool's result render back into the prompt
    follow = client.chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=8, temperature=0,
                                            messages=[
        *ASK, {"role": "assistant", "content": None,
               "tool_calls": [t.model_dump() for t in msg.tool_calls]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp": 21}'}])
    assert follow.choices[0].finish_reason in ("stop", "length")


def test_auto_without_a_call_gives_content(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL,
                                         messages=[{"role": "user", "content": "Say hi."}],
                                         tools=TOOLS, tool_choice="auto", max_tokens=8,
                                         temperature=0)
    msg = out.choices[0].message
    assert msg.content and not msg.tool_calls and out.choices[0].finish_reason != "tool_calls"
