"""The gateway against a fake engine: OpenAI shapes, SSE framing, errors, and disconnect ->
ABORT."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer, get_port_socket

from gateway.app import build_app
from gateway.state import GatewayConfig
from shared.client import AsyncEngineClient
from tests.fakes import FakeEngine, smollm2_tokenizer

ANSWER = " The capital of France is Paris. 你好 😀"
MODEL = "SmolLM2-135M-Instruct"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


class NoCancelServer(TestServer):
    """aiohttp's default: handlers are not cancelled on disconnect; only a failed write tells."""

    async def _make_runner(self, **kwargs: Any) -> Any:
        return await super()._make_runner(**{**kwargs, "handler_cancellation": False})


@contextlib.asynccontextmanager
async def gateway(eng: FakeEngine, cancel: bool = True, socket_factory: Any = get_port_socket,
                  resume_timeout: float = 60.0, **config: Any) -> AsyncIterator[TestClient]:
    client = AsyncEngineClient(eng.address, tokenizer=smollm2_tokenizer(), ready_timeout=3,
                               resume_timeout=resume_timeout)
    app = build_app(GatewayConfig(**config), client)
    async with TestClient((TestServer if cancel
                           else NoCancelServer)(app, socket_factory=socket_factory)) as http:
        yield http


def answer_ids() -> list[int]:
    return smollm2_tokenizer().encode(ANSWER)


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events), events
    return [e[len(b"data: "):] for e in events]


def test_models_health_tokenize_detokenize() -> None:
    async def main() -> None:
        with FakeEngine(max_model_len=321) as eng:
            async with gateway(eng) as http:
                models = await (await http.get("/v1/models")).json()
                assert models["data"][0]["id"] == MODEL
                assert models["data"][0]["max_model_len"] == 321
                assert (await http.get("/health")).status == 200
                tok = await (await http.post("/tokenize", json={"prompt": "Hello 你好"})).json()
                assert tok["tokens"] == smollm2_tokenizer().encode("Hello 你好")
                assert tok["count"] == len(tok["tokens"])
                text = await (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
                assert text == {"prompt": "Hello 你好"}
                messages = [{"role": "user", "content": "hi"}]
                chat = await (await http.post("/tokenize", json={"messages": messages})).json()
                assert chat["count"] > 5
                missing = await http.get("/v1/nope")
                assert missing.status == 404 and "error" in await missing.json()
    run(main())


def test_completion_non_streaming_has_usage() -> None:
    async def main() -> None:
        with FakeEngine(tokens=answer_ids(), tokens_per_step=3) as eng:
            async with gateway(eng) as http:
                resp = await http.post("/v1/completions",
                                       json={"model": MODEL, "prompt": "Capital of France?",
                                             "max_tokens": 50})
                assert resp.status == 200, await resp.text()
                body = await resp.json()
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == ANSWER
        assert body["choices"][0]["finish_reason"] == "stop"
        n_prompt = len(smollm2_tokenizer().encode("Capital of France?"))
        assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(answer_ids()),
                                 "total_tokens": n_prompt + len(answer_ids())}
    run(main())


def test_completion_streaming_sse_framing() -> None:
    async def main() -> None:
        with FakeEngine(tokens=answer_ids()) as eng:
            async with gateway(eng) as http:
                resp = await http.post("/v1/completions",
                                       json={"prompt": [1, 2, 3], "max_tokens": 5, "stream": True})
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                events = sse_events(await resp.read())
        assert events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
        assert "".join(c["choices"][0]["text"]
                       for c in chunks) == smollm2_tokenizer().decode(answer_ids()[:5])
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    run(main())


def test_chat_streaming_role_first_and_usage_last() -> None:
    async def main() -> None:
        with FakeEngine(tokens=answer_ids()) as eng:
            async with gateway(eng) as http:
                parts = [{"type": "text", "text": "Capital?"}]
                body = {"model": MODEL, "messages": [{"role": "user", "content": parts}],
                        "stream": True, "stream_options": {"include_usage": True}}
                resp = await http.post("/v1/chat/completions", json=body)
                events = sse_events(await resp.read())
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert events[-1] == b"[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == ANSWER
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == len(answer_ids())
    run(main())


def test_chat_non_streaming_and_stop_string_aborts() -> None:
    async def main() -> None:
        with FakeEngine(tokens=answer_ids() * 5, step_interval=0.005) as eng:
            async with gateway(eng) as http:
                body = {"messages": [{"role": "user", "content": "Capital?"}], "stop": "Paris",
                        "max_tokens": 100}
                resp = await (await http.post("/v1/chat/completions", json=body)).json()
                assert resp["object"] == "chat.completion"
                assert resp["choices"][0]["message"] == {"role": "assistant",
                                                         "content": " The capital of France is "}
                assert resp["choices"][0]["finish_reason"] == "stop"
                # the engine stops generating too
                assert eng.wait_for(lambda: len(eng.aborted) == 1)
    run(main())


LONG_PROMPT = "word " * 80


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/completions", b"{not json", None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", None, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, "model", "does not exist"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     "max_tokens",
     "in [1, "),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 10}, "prompt",
     "maximum context length is 64"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages",
     "maximum context"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo", "true or false"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "echo=true"),
    ("/v1/completions", {"prompt": []}, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": ["hi", [1, 10**9]]}, "prompt", "prompt[1]: token ids"),
    ("/v1/completions", {"prompt": ["hi", []]}, "prompt", "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "stream"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs",
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": [1, 10**9]}, "prompt", "token ids"),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty"),
])
def test_openai_error_bodies(path: str, body: Any, param: str | None, needle: str) -> None:
    async def main() -> None:
        with FakeEngine(max_model_len=64) as eng:
            async with gateway(eng) as http:
                kw = {"data": body} if isinstance(body, bytes) else {"json": body}
                resp = await http.post(path, **kw)
                assert resp.status == 400
                err = (await resp.json())["error"]
                assert set(err) == {"message", "type", "param", "code"} and needle in err["message"]
                assert err["param"] == param and err["type"] == "invalid_request_error"
                assert eng.adds() == []  # refused at the edge: the engine never saw it
    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_engine_error_becomes_400(stream: bool) -> None:
    async def main() -> None:
        with FakeEngine(reject=lambda add: "the engine says no") as eng:
            async with gateway(eng) as http:
                resp = await http.post("/v1/completions", json={"prompt": "hi", "stream": stream})
                assert resp.status == 400
                assert "the engine says no" in (await resp.json())["error"]["message"]
    run(main())


@pytest.mark.parametrize("cancel", [True, False], ids=["handler-cancelled", "write-fails"])
def test_client_disconnect_aborts_in_engine(cancel: bool) -> None:
    async def main() -> None:
        with FakeEngine(tokens=list(range(300, 2300)), step_interval=0.01,
                        max_model_len=4096) as eng:
            async with gateway(eng, cancel=cancel) as http:
                resp = await http.post("/v1/completions",
                                       json={"prompt": "hi", "max_tokens": 1000, "stream": True})
                assert (await resp.content.readline()).startswith(b"data: ")
                resp.close()  # the client goes away mid-stream
                assert await asyncio.to_thread(eng.wait_for, lambda: len(eng.aborted) == 1, 5)
                assert eng.aborted == [eng.adds()[0].request_id]
                assert (await http.get("/health")).status == 200  # and the server is fine
    run(main())
