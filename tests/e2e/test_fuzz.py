"""Property-based fuzzing of a real `conveyor serve` on a tiny random chat model: OpenAI bodies
over HTTP, SamplingParams over the wire through the SDK, and malformed ZeroMQ frames straight at
the engine loop.

Whatever arrives, the answer is a 200 or a 400 in OpenAI's error shape (a typed SDK error, an ERROR
frame, or a silent drop), the server then serves a normal request, and at the end the engine holds
no request and every KV block is free.

Token ids in stop_token_ids and logit_bias are drawn on both sides of the vocabulary's end: ids
beyond it are the engine's own check (EngineCore.add, against the model, engine/admission.py), and
an unchecked one once stopped the engine inside the sampler. Prompt ids beyond it are drawn too: the
gateway checks those.
"""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

import orjson
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shared import protocol as P
from shared.client import AsyncEngineClient
from shared.errors import ConveyorError, InvalidRequest
from shared.sampling import SamplingParams
from tests.e2e.conftest import TINY_CHAT
from tests.e2e.servers import Server, is_idle, wait_engine_idle

pytestmark = pytest.mark.slow
VOCAB = int(TINY_CHAT["vocab_size"])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with Server(["serve", "--model", str(tiny_chat_model), "--num-threads", "1",
                 "--kv-cache-memory", "32MiB", "--log-level", "warning"], log_path=log) as srv:
        yield srv


# -- strategies ------------------------------------------------------------------------------------

# Mostly inside the vocabulary, sometimes just past it or far past it (see the module docstring).
TOKEN = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, VOCAB + 2),
                  st.integers(VOCAB, 2**31 - 1))
EXTREME = st.sampled_from([0, -1, 1, 2, 65, 2**31, 2**63 - 1, -(2**63), 1e308, -1e308, 5e-324, 0.5,
                           -0.001, 1000, -1000, 100.0001, 1.0])
WRONG = st.one_of(st.text(max_size=4), st.booleans(), st.none(),
                  st.lists(st.integers(0, 9), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(-200, 200), max_size=2))


BAD = st.one_of(EXTREME, WRONG)

# Valid values of each field; a body takes any of them (their combinations may still be refused,
# e.g. beam search with a temperature), then up to two fields get an extreme or wrongly typed value.
SAMPLING = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop_token_ids": st.lists(TOKEN, max_size=3),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3),
    "n": st.integers(1, 3),
    "best_of": st.integers(1, 4), "use_beam_search": st.booleans(), "beam_width": st.integers(1, 4),
    "length_penalty": st.floats(-2, 2), "early_stopping": st.sampled_from([True, False, "never"]),
    "speculative": st.booleans(),
    "stop": st.one_of(st.text(min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), max_size=2)),
}
MAX_TOKENS = st.integers(1, 6)
OPENAI = {
    **SAMPLING, "priority": st.integers(-5, 5), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.integers(0, 3),
    "user": st.text(max_size=4), "model": st.just("tiny-chat"), "echo": st.just(False),
    "response_format": st.none(), "tools": st.none(), "top_logprobs": st.integers(0, 3),
}
BAD_OPENAI = {"max_tokens": BAD, **{k: BAD for k in OPENAI}, "unknown_field": WRONG,
              "model": st.just("gpt-4"), "echo": st.just("yes"),
              "response_format": st.just({"type": "xml"}), "tools": st.just([1]),
              "tool_choice": st.just("auto"), "guided_regex": st.just("a(b")}


def bodies(required: dict[str, Any], valid: dict[str, Any],
           bad: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A body of valid fields with up to two of them (or unsupported / unknown ones) spoiled."""
    spoiled = st.lists(st.sampled_from(sorted(bad)), max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: bad[k] for k in keys}))
    return st.tuples(st.fixed_dictionaries(required, optional=valid),
                     spoiled).map(lambda t: {**t[0], **t[1]})


PROMPT = st.one_of(st.text(max_size=16),
                   st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                           "content": st.text(max_size=12)}), min_size=1,
                    max_size=3)
BAD_IDS = st.lists(st.integers(-2, VOCAB + 2), max_size=4)
COMPLETION_BODY = bodies({"prompt": PROMPT, "max_tokens": MAX_TOKENS},
                         {k: v for k, v in OPENAI.items() if k != "top_logprobs"},
                         {**BAD_OPENAI, "prompt": st.one_of(BAD, BAD_IDS)})
BAD_MESSAGE = st.fixed_dictionaries({"role": WRONG, "content": BAD})
CHAT_BODY = bodies({"messages": MESSAGES, "max_tokens": MAX_TOKENS},
                   {**{k: v for k, v in OPENAI.items() if k not in ("echo", "best_of")},
                    "max_completion_tokens": MAX_TOKENS, "logprobs": st.booleans()},
                   {**BAD_OPENAI, "max_completion_tokens": BAD,
                    "messages": st.one_of(BAD, st.lists(BAD_MESSAGE))})
SAMPLING_DICT = bodies({"max_tokens": MAX_TOKENS}, SAMPLING,
                       {"max_tokens": BAD, **{k: BAD for k in SAMPLING}})


def post(url: str, body: Any) -> tuple[int, bytes, str]:
    req = urllib.request.Request(url, data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


def check_answer(status: int, raw: bytes, content_type: str) -> None:
    assert status in (200, 400), (status, raw[:500])
    event(f"HTTP {status}" + (f" {json.loads(raw)['error']['param']}" if status == 400 else ""))
    if status == 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param",
                            "code"} and err["type"] == "invalid_request_error", err
        assert isinstance(err["message"], str) and err["message"], err
    elif content_type.startswith("text/event-stream"):
        events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"[DONE]" and all(b'"error"' not in e[:10] for e in events), raw[-500:]
    else:
        assert json.loads(raw)["choices"], raw[:500]


def serves_normally(url: str) -> None:
    status, raw, _ = post(f"{url}/v1/completions",
                          {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                           "ignore_eos": True})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4, raw[:500]


def assert_engine_idle(address: str) -> None:
    stats = asyncio.run(asyncio.wait_for(wait_engine_idle(address, timeout=60), 90))
    assert is_idle(stats), stats


# -- (b) OpenAI bodies over HTTP -------------------------------------------------------------------

@pytest.mark.parametrize(("path", "bodies"),
                         [("/v1/completions", COMPLETION_BODY),
                          ("/v1/chat/completions", CHAT_BODY)], ids=["completions", "chat"])
def test_fuzzed_openai_bodies_get_200_or_400(server: Server, engine_address: str, path: str,
                                             bodies: st.SearchStrategy[dict[str, Any]]) -> None:
    @FUZZ
    @given(body=bodies)
    def one(body: dict[str, Any]) -> None:
        if body.get("model") == "tiny-chat":
            body["model"] = Path(server.argv[server.argv.index("--model") + 1]).name
        check_answer(*post(f"{server.url}{path}", body))

    one()
    serves_normally(server.url)
    assert_engine_idle(engine_address)


# -- (c) SamplingParams over the wire through the SDK ----------------------------------------------

def unchecked(d: dict[str, Any]) -> SamplingParams:
    """A SamplingParams the SDK would refuse, built without validation, so the engine's own
    check is tried."""
    p = object.__new__(SamplingParams)
    for f in fields(SamplingParams):
        object.__setattr__(p, f.name, d.get(f.name, f.default))
    return p


def test_fuzzed_sampling_params_through_the_sdk(server: Server, engine_address: str) -> None:
    @FUZZ
    @given(d=SAMPLING_DICT)
    def one(d: dict[str, Any]) -> None:
        try:
            params, valid = SamplingParams.from_dict(d), True
        except InvalidRequest as e:  # the SDK's typed error, naming a field the dict holds
            assert e.param in d, (e.param, d)
            params, valid = unchecked(d), False
        # Ids past the vocabulary: valid on their own, refused by the engine, which knows the model.
        valid = (valid and all(t < VOCAB for t in params.stop_token_ids)
                 and all(t < VOCAB for t, _ in params.logit_bias))

        async def send() -> str:
            async with AsyncEngineClient(engine_address, name="fuzz", ready_timeout=120) as client:
                try:
                    stream = await client.add([1, 5, 9, 14], params)
                    async for out in stream:
                        if out.finished:
                            return "done"
                    return "ended"
                except ConveyorError as e:
                    return type(e).__name__

        outcome = asyncio.run(asyncio.wait_for(send(), 120))
        event(outcome)
        # the engine agrees with the SDK: it completes what the SDK accepts and refuses
        # what it refuses
        assert outcome == ("done" if valid else "InvalidRequest"), (outcome, d)

    one()
    serves_normally(server.url)
    assert_engine_idle(engine_address)


# -- (d) malformed frames at the engine loop -------------------------------------------------------

VALID_ADD = {"request_id": "raw", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 2},
             "priority": 0}
FRAMES = st.one_of(
    st.lists(st.binary(max_size=8), min_size=1, max_size=4),  # garbage, missing and extra frames
    # invalid JSON
    st.tuples(st.sampled_from([t.value for t in P.MsgType]), st.binary(max_size=16)).map(list),
    st.tuples(st.sampled_from([t.value for t in P.MsgType]),  # valid JSON, wrong shapes
              st.one_of(WRONG, st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False))
              ).map(lambda t: [t[0], orjson.dumps(t[1])]),
    st.fixed_dictionaries({}, optional={  # ADDs with a field missing or of the wrong type
        "request_id": st.one_of(st.just("raw"), WRONG),
        "prompt_token_ids": st.one_of(st.just([1, 2]), WRONG, EXTREME),
        "params": st.one_of(st.just({"max_tokens": 2}), WRONG,
                            st.fixed_dictionaries({}, optional=SAMPLING)),
        "priority": st.one_of(st.integers(-5, 5), BAD),
    }).map(lambda d: [P.MsgType.ADD.value, orjson.dumps(d)]),
)


def test_malformed_frames_get_an_error_or_are_dropped(server: Server, engine_address: str) -> None:
    ctx = zmq.Context()

    @FUZZ
    @given(frames=FRAMES)
    def one(frames: list[bytes]) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine_address)
        try:
            sock.send_multipart(frames)
            # answered in order: what comes before is the answer
            sock.send_multipart(P.encode(P.GetStats()))
            while True:
                assert sock.poll(60_000), (
                    "the engine did not answer GET_STATS after a malformed message")
                reply = P.decode(sock.recv_multipart())
                if isinstance(reply, P.Stats):
                    return
                # an ERROR, or what a message that happened to be valid asks for (HELLO -> READY,
                # ADD -> OUTPUTS)
                assert isinstance(reply, (P.Error, P.Ready, P.Outputs)), reply
        finally:
            sock.close()

    try:
        one()
    finally:
        ctx.destroy(linger=0)
    serves_normally(server.url)
    assert_engine_idle(engine_address)
