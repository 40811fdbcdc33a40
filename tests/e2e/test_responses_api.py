"""OpenAI's Responses API through the official `openai` SDK against a real `conveyor serve`
(tiny random chat model, float32, greedy). The reference for every text is the chat-completions
route given the same conversation: the two doors must build the same request and stream the
same output."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseFunctionToolCallOutputItem,
    ResponseInputMessageItem,
    ResponseInputParam,
    ResponseInputText,
    ResponseTextConfigParam,
)
from pydantic import BaseModel, Field

from tests.conftest import error_body, present
from tests.e2e.sdk import as_type, extra_field, final_response
from tests.e2e.servers import Server, tiny_serve

pytestmark = pytest.mark.slow
MODEL = "tiny-chat"
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
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": WEATHER,
    }
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("responses") / "server.log"
    with Server(
        tiny_serve(tiny_chat_model, "--dtype", "float32", "--tool-call-parser", "hermes",
                   "--responses-store-size", "8"),
        log_path=log,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat_text(
    client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int, **kw: Any
) -> str:
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )
    return out.choices[0].message.content or ""


def test_plain_text_equals_the_chat_route_and_streams_the_same(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL,
        input="Tell me a story.",
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0,
    )
    r = client.responses.create(**kw)
    want = chat_text(
        client,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a story."},
        ],
        12,
    )
    assert r.output_text == want and want
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.instructions == "Be brief."
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    final = final_response(events)
    assert final.output_text == want and present(final.usage).output_tokens == 12


def test_function_tool_loop(client: openai.OpenAI) -> None:
    ask: ResponseInputParam = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(
        model=MODEL,
        input=ask,
        tools=TOOLS,
        max_output_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = as_type(r.output[0], ResponseFunctionToolCall)
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed = list(
        client.responses.create(
            model=MODEL,
            input=ask,
            tools=TOOLS,
            max_output_tokens=60,
            temperature=0,
            tool_choice="required",
            stream=True,
            parallel_tool_calls=False,
        )
    )
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args == call.arguments
    # the result goes back as function_call_output; the model answers with a message
    follow: list[Any] = [  # the call goes back as the JSON it came as
        *ask,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
    ]
    answer = client.responses.create(
        model=MODEL, input=follow, tools=TOOLS, max_output_tokens=8, temperature=0
    )
    assert [o.type for o in answer.output] == ["message"] and answer.output_text
    want = chat_text(
        client,
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'},
        ],
        8,
        tools=[
            {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}
        ],
    )
    assert answer.output_text == want


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    fmt: ResponseTextConfigParam = {
        "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    }
    r = client.responses.create(
        model=MODEL, input="A person, please.", text=fmt, max_output_tokens=60, temperature=0
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), PERSON)
    r = client.responses.create(
        model=MODEL,
        input="Some JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=8,
        temperature=0,
    )
    fmt_out = present(r.text).format
    assert fmt_out is not None
    assert r.output_text.startswith("{") and fmt_out.type == "json_object"  # cut at 8 tokens


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="Hi there.", instructions="Be kind.", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model=MODEL,
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # instructions are not carried over (as OpenAI): the second turn renders without them
    want = chat_text(
        client,
        [
            {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        6,
    )
    assert second.output_text == want
    streamed = list(
        client.responses.create(
            model=MODEL,
            input="And then?",
            previous_response_id=first.id,
            max_output_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert final_response(streamed).output_text == want


def test_input_items_list_pages_through_the_input(client: openai.OpenAI) -> None:
    """The SDK's input_items.list: newest first by default, limit / order / after honoured (the
    SDK's auto-paging follows `after` and `has_more`), ids as sent or made up."""
    sent: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "id": "fc_given", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "celsius"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = client.responses.create(model=MODEL, input=sent, tools=TOOLS, max_output_tokens=4)
    page = client.responses.input_items.list(r.id)
    assert [i.type for i in page.data] == [
        "function_call_output", "function_call", "message", "message"]  # desc: newest first
    assert page.has_more is False and extra_field(page, "first_id") == page.data[0].id
    assert extra_field(page, "last_id") == page.data[-1].id and page.data[1].id == "fc_given"
    assert len({i.id for i in page.data}) == 4
    asc = list(client.responses.input_items.list(r.id, order="asc", limit=1))  # 4 pages of 1
    assert [i.id for i in asc] == [i.id for i in reversed(page.data)]
    developer, user = as_type(asc[0], ResponseInputMessageItem), as_type(asc[1],
                                                                         ResponseInputMessageItem)
    assert developer.role == "developer" and as_type(developer.content[0],
                                                     ResponseInputText).text == "Be brief."
    assert user.content[0].type == "input_text"
    assert as_type(asc[3], ResponseFunctionToolCallOutputItem).output == "sunny"
    two = client.responses.input_items.list(r.id, order="asc", limit=2, after=asc[0].id)
    assert [i.id for i in two.data] == [asc[1].id, asc[2].id] and two.has_more is True
    one = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    [listed] = client.responses.input_items.list(one.id).data
    item = as_type(listed, ResponseInputMessageItem)
    assert (item.type, item.role,
            as_type(item.content[0], ResponseInputText).text) == ("message", "user", "Hello")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(r.id, limit=101)
    assert error_body(e.value.body)["param"] == "limit"
    with pytest.raises(openai.NotFoundError) as nf:
        client.responses.input_items.list("resp_gone")
    assert nf.value.status_code == 404 and "resp_gone" in error_body(nf.value.body)["message"]


def test_retrieve_delete_and_unknown_ids(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    for call in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: client.responses.create(model=MODEL, input="x", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404 and r.id in e.value.message
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, store=False)
    assert extra_field(unstored, "store") is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_is_bounded(client: openai.OpenAI) -> None:
    ids = [
        client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1).id
        for i in range(9)
    ]
    with pytest.raises(openai.NotFoundError):  # --responses-store-size 8: the oldest went first
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"foo": 1}, "foo"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "x", "bogus": 1}]}
                ]
            },
            "input[0].content[0].bogus",
        ),
        ({"input": [{"role": "user", "content": "x", "name": "me"}]}, "input[0].name"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}
                ]
            },
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "input_file", "file_id": "f"}]}, "input[0].type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**TOOLS[0], "extra": True}]}, "tools[0].extra"),
        (
            {"text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON, "x": 1}}},
            "text.format.x",
        ),
        ({"text": {"format": {"type": "text"}, "y": 1}}, "text.y"),
        (
            {"tool_choice": {"type": "function", "name": "get_weather", "z": 1}, "tools": TOOLS},
            "tool_choice.z",
        ),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_unknown_and_unsupported_fields_are_400s_that_name_them(
    client: openai.OpenAI, extra: dict, param: str
) -> None:
    body: dict[str, Any] = {"input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=MODEL,
            **{k: v for k, v in body.items() if k in _SDK},
            extra_body={k: v for k, v in body.items() if k not in _SDK},
        )
    assert e.value.status_code == 400 and error_body(e.value.body)["param"] == param, e.value.body
    assert param.split(".")[-1].split("[")[0] in e.value.message


_SDK = (
    "input",
    "max_output_tokens",
    "tools",
    "text",
    "tool_choice",
    "background",
    "reasoning",
    "include",
)


@pytest.mark.parametrize("transport", ["http", "websocket"])
def test_the_agents_sdk_runs_an_agent_with_a_function_tool(server: Server, transport: str) -> None:
    """The OpenAI Agents SDK on its default model (the Responses API), over HTTP and over its
    WebSocket transport: a forced first call (the grammar makes the tiny model call the tool), the
    tool runs, the agent answers in its output type (a JSON schema)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        OpenAIResponsesWSModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny, 21 C"

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        kind = OpenAIResponsesWSModel if transport == "websocket" else OpenAIResponsesModel
        model = kind(model=MODEL, openai_client=client)
        agent = Agent(
            name="weather",
            instructions="Say the weather.",
            tools=[get_weather],
            output_type=Answer,
            model=model,
            model_settings=ModelSettings(
                tool_choice="get_weather", parallel_tool_calls=False, max_tokens=80, temperature=0
            ),
        )
        try:
            whole = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
            streamed = Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=4)
            kinds = [e.type async for e in streamed.stream_events()]
        finally:
            if isinstance(model, OpenAIResponsesWSModel):
                await model.close()
        assert "raw_response_event" in kinds
        return [whole, streamed]

    whole, streamed = asyncio.run(run())
    for result in (whole, streamed):
        assert isinstance(result.final_output, Answer), result.final_output
        items = [i.type for i in result.new_items]
        assert (
            items[:2] == ["tool_call_item", "tool_call_output_item"]
            and items[-1] == "message_output_item"
        )
    assert len(asked) == 2 and set(asked) <= {"Paris", "Rome"}


TERMINAL = ("response.completed", "response.incomplete", "error")


async def _until_end(conn: Any) -> list[Any]:
    events: list[Any] = []
    while not events or events[-1].type not in TERMINAL:
        events.append(await asyncio.wait_for(conn.recv(), 60))
    return events


def test_websocket_mode_chains_responses_on_one_socket(
    server: Server, client: openai.OpenAI
) -> None:
    """OpenAI's WebSocket mode through the SDK's own client (responses.connect): response.create
    messages on one socket, the second chained to the first (stored nowhere but on the socket)."""

    async def run() -> tuple[list[Any], ...]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        async with aclient.responses.connect() as conn:
            await conn.response.create(
                model=MODEL, input="Hi there.", max_output_tokens=6, temperature=0, store=False
            )
            first = await _until_end(conn)
            await conn.response.create(
                model=MODEL,
                input="And then?",
                max_output_tokens=6,
                temperature=0,
                previous_response_id=first[-1].response.id,
            )
            second = await _until_end(conn)
            await conn.send_raw(json.dumps({"type": "response.create", "input": "x", "bogus": 1}))
            error = await _until_end(conn)
            for text in ("one", "two"):  # back to back on one lane: the second waits for the first
                await conn.response.create(
                    model=MODEL, input=text, max_output_tokens=3, stream_id="lane"
                )
            both = await _until_end(conn) + await _until_end(conn)
        return first, second, error, both

    first, second, error, both = asyncio.run(run())
    whole = client.responses.create(
        model=MODEL, input="Hi there.", max_output_tokens=6, temperature=0
    )
    assert first[-1].response.output_text == whole.output_text
    assert [e.type for e in first][:2] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in first] == list(range(len(first)))
    assert (
        "".join(e.delta for e in first if e.type == "response.output_text.delta")
        == whole.output_text
    )
    want = chat_text(
        client,
        [
            {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": whole.output_text},
            {"role": "user", "content": "And then?"},
        ],
        6,
    )
    assert second[-1].response.output_text == want
    with pytest.raises(openai.NotFoundError):  # store: false kept it on the socket only
        client.responses.retrieve(first[-1].response.id)
    assert (
        error[-1].type == "error" and error[-1].status == 400 and error[-1].error.param == "bogus"
    )
    ends = [i for i, e in enumerate(both) if e.type in TERMINAL]
    assert ends == [ends[0], len(both) - 1] and all(e.stream_id == "lane" for e in both)
    assert both[0].response.id != both[-1].response.id


class Answer(BaseModel):
    sky: Literal["sunny", "rainy"]
    degrees: int = Field(ge=-50, le=60)
