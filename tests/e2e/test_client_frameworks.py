"""Structured output through the frameworks users call Conveyor with, against a real `conveyor
serve` (tiny random chat model: the grammar, not the weights, makes outputs valid): OpenAI's
json_object with a `schema` (validated with jsonschema), instructor in JSON_SCHEMA and TOOLS modes,
pydantic-ai's agent with an output type, LangChain's with_structured_output (json_schema and
function calling), LangChain's and the Agents SDK's tool loops. Each framework validates the answer
itself (pydantic); no retries are allowed, so the first answer must validate."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, SecretStr

from tests.e2e.servers import Server, tiny_serve
from tests.e2e.test_structured_api import ASK, MODEL, PERSON

pytestmark = pytest.mark.slow


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("frameworks") / "server.log"
    with Server(
        tiny_serve(tiny_chat_model, "--tool-call-parser", "hermes", "--served-model-name", MODEL),
        log_path=log,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_json_object_with_a_schema_is_that_schema(client: openai.OpenAI) -> None:
    """{"type": "json_object", "schema": ...}: the schema is enforced, not just "some object"."""
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=80,
        temperature=1.0,
        response_format={"type": "json_object", "schema": PERSON},
    )
    for seed in range(3):
        out = client.chat.completions.create(**kw, seed=seed)
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    done = client.completions.create(
        model=MODEL,
        prompt="A person:",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": {"type": "json_object", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(client: openai.OpenAI, mode: str) -> None:
    import instructor

    ic = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    pet = ic.chat.completions.create(
        model=MODEL,
        response_model=Pet,
        messages=ASK,
        max_tokens=80,
        temperature=0.7,
        seed=2,
        max_retries=0,
    )
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def test_pydantic_ai_agent_with_an_output_type(server: Server) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="none")
    )
    agent = Agent(
        model, output_type=Pet, retries=0, model_settings={"max_tokens": 80, "temperature": 0.7}
    )
    result = asyncio.run(agent.run("Describe a pet."))
    assert isinstance(result.output, Pet)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(
    server: Server, method: Literal["json_schema", "function_calling"]
) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{server.url}/v1",
        api_key=SecretStr("none"),
        max_tokens=80,  # type: ignore[call-arg]  # a pydantic alias of max_completion_tokens
        temperature=0.7,
        seed=3,
        max_retries=0,
    )
    pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet.")
    assert isinstance(pet, Pet)


def test_langchain_tool_loop_streamed(server: Server) -> None:
    """bind_tools with a forced call, the tool's result sent back (LangChain's own message dicts:
    every key it sends must be known), then a streamed answer."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(
        city: Literal["Oslo", "Paris"],
    ) -> str:  # an enum: a random model's string never ends
        """Weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{server.url}/v1",
        api_key=SecretStr("none"),
        max_tokens=120,  # type: ignore[call-arg]  # a pydantic alias of max_completion_tokens
        temperature=0,
        max_retries=0,
    )
    ask = [HumanMessage("Weather in Oslo?", name="ann")]
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(ask)
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather", call
    history = [
        *ask,
        call,
        ToolMessage(
            get_weather.invoke(call.tool_calls[0]["args"]), tool_call_id=call.tool_calls[0]["id"]
        ),
    ]
    parts = list(llm.bind_tools([get_weather]).stream(history))
    whole = llm.bind_tools([get_weather]).invoke(history)
    assert "".join(str(p.content) for p in parts) == whole.content


def test_openai_agents_sdk_on_chat_completions(server: Server) -> None:
    """The Agents SDK's chat-completions model: a forced tool call, its result sent
    back, an answer."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """Weather in a city."""
        calls.append(city)
        return "sunny"

    model = OpenAIChatCompletionsModel(
        MODEL, AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    )
    agent = Agent(
        name="w",
        instructions="Answer briefly.",
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0
        ),
    )
    result = Runner.run_sync(agent, "Weather in Oslo?", max_turns=4)
    assert len(calls) == 1 and isinstance(
        result.final_output, str
    )  # reset_tool_choice: auto after the call
