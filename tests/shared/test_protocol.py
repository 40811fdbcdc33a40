"""The wire: every message survives encode/decode; anything malformed is a ProtocolError,
nothing else."""
from __future__ import annotations

import contextlib
import random

import orjson
import pytest

from shared import protocol as P
from shared.embedding import PoolingInfo, PoolingParams
from shared.errors import ProtocolError
from shared.sampling import SamplingParams

MESSAGES: list[P.Message] = [
    P.Hello(),
    P.Hello(protocol_version=P.PROTOCOL_VERSION - 1),
    P.Ready(P.PROTOCOL_VERSION, "SmolLM2-135M-Instruct", 2048),
    P.Ready(P.PROTOCOL_VERSION, "m", 2048, max_message_size=3 * 2**20, heartbeat_interval=1.0),
    P.Ready(P.PROTOCOL_VERSION, "m", 2048,
            pooling=PoolingInfo("mean", True, 64, True, (32, 64)).to_dict()),
    P.Heartbeat(),
    P.Add("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, stop=("\n\n",),
                                          stop_token_ids=(7,), seed=3)),
    P.Add("r2", [0], SamplingParams(), priority=-2),
    P.Abort(["r1", "r2"]),
    P.Abort([]),
    P.StopChoice("r1", 2),
    P.StopChoice("r2", 0),
    P.Outputs([]),
    P.Outputs([P.RequestOutput("r1", [5, 6]), P.RequestOutput("r2", [], True, "abort", 3, 2)]),
    P.Error("r1", "prompt is too long", 400),
    P.Error(None, "malformed message", 400),
    P.GetStats(),
    P.Stats({"num_running": 3.0, "kv_cache_usage": 0.25}),
    P.ResetPrefixCache(),
    P.Outputs([P.RequestOutput("r3", [9], False, "stop", 4, 0, None,
                               [[-0.5, [[9, -0.5], [4, -1.5]]]], 2)]),
    P.Add("r4", [1], SamplingParams(n=2, best_of=3, logprobs=2, logit_bias=((5, -1.0),),
                                    repetition_penalty=1.2)),
    P.Add("r5", [1, 2], SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1)),
    P.Outputs([P.RequestOutput("r5", [9], True, "length", 2, 0, None, None, 0,
                               [None, [-2.5, 3, [[7, -0.25]]]])]),
    P.Add("r6", [1, 2], SamplingParams(max_tokens=1), pooling=PoolingParams(32)),
    P.Add("r7", [1], SamplingParams(thinking_token_budget=4, reasoning_end_ids=(9, 10, 11),
                                    reasoning_end_spellings=((8, 10, 11), (9, 10, 12), (13,)))),
    P.Outputs([P.RequestOutput("r6", [], True, "stop", 2, 0, None, None, 0, None, [0.5, -0.25])]),
    P.Observe(3.0),
    P.Observe(0.0),
    P.Observed([[1, 1.5, 8, 0, 1, 0.01, 0, 0, 0, 1]], None),
    P.Observed([], {"step": 3, "blocks": [-2, -1, 0], "shared": [[2, 2]]}, [0.1], [0.02, 0.03]),
    P.Trace(True),
    P.Trace(False),
    P.TraceData({"traceEvents": [{"name": "step 1", "ph": "X", "pid": 1, "tid": 1, "ts": 0.0,
                                  "dur": 5.0}]}),
]


def test_old_readers_ignore_new_output_fields_and_new_readers_default_missing_ones() -> None:
    def decode_outputs(rows: list[object]) -> P.Outputs:
        msg = P.decode([P.MsgType.OUTPUTS.value, orjson.dumps(rows)])
        assert isinstance(msg, P.Outputs)
        return msg

    # what a version-1 engine sent before logprobs / index
    row: list[object] = ["r1", [5], True, "stop", 3, 1, None]
    out = decode_outputs([row]).outputs[0]
    assert out.logprobs is None and out.index == 0
    # logprobs, index, prompt_logprobs, embedding, ...
    future = [None, 0, None, None, "a future field"]
    longer = decode_outputs([row + future]).outputs[0]
    assert longer == out


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: P.Message) -> None:
    frames = P.encode(msg)
    assert len(frames) == 2 and all(isinstance(f, bytes) for f in frames)
    assert P.decode(frames) == msg


@pytest.mark.parametrize("frames", [[P.MsgType.OBSERVE.value, b'{"seconds": -1}'],
                                    [P.MsgType.OBSERVE.value, b'{"seconds": true}'],
                                    [P.MsgType.TRACE.value, b'{"on": 1}']])
def test_observe_and_trace_refuse_bad_values(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        P.decode(frames)


def test_an_older_clients_hello_decodes_so_the_engine_can_name_the_version() -> None:
    """Protocol 5's HELLO named the client: it still decodes, to be answered "protocol version 5 is
    not 6" rather than with a decoding error."""
    old = P.decode([P.MsgType.HELLO.value,
                    orjson.dumps({"protocol_version": 5, "client_name": "gateway-1"})])
    assert old == P.Hello(5)


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(P._TYPES)


def test_every_message_type_has_its_own_byte() -> None:
    """A repeated byte would make the second member an alias of the first: one byte,
    two meanings."""
    assert len({t.value for t in P.MsgType}) == len(P.MsgType.__members__) == len(P._TYPES)
    assert P.encode(P.StopChoice("r", 1))[0] != P.encode(P.Abort(["r"]))[0]


def test_decode_accepts_zmq_style_buffers() -> None:
    frames = P.encode(P.Abort(["x"]))
    zmq_frames = [memoryview(frames[0]), memoryview(frames[1])]
    assert P.decode(zmq_frames) == P.Abort(["x"])  # type: ignore[arg-type]


def _add_payload(**changes: object) -> bytes:
    d = orjson.loads(P.encode(P.Add("r9", [1, 2], SamplingParams()))[1])
    d.update(changes)
    return orjson.dumps(d)


MALFORMED: dict[str, list[bytes]] = {
    "one frame": [b"H"],
    "three frames": [b"H", b"{}", b"{}"],
    "unknown type byte": [b"Z", b"{}"],
    "empty type frame": [b"", b"{}"],
    "bad json": [b"A", b"{not json"],
    "empty payload": [b"H", b""],
    "add without prompt": [b"A", orjson.dumps({"request_id": "r", "params": {}})],
    "add payload is a list": [b"A", b"[1, 2]"],
    "add empty prompt": [b"A", _add_payload(prompt_token_ids=[])],
    "add negative token": [b"A", _add_payload(prompt_token_ids=[1, -5])],
    "add token is a string": [b"A", _add_payload(prompt_token_ids=["a"])],
    "add request id not a string": [b"A", _add_payload(request_id=5)],
    "add bad priority": [b"A", _add_payload(priority="high")],
    "ready missing fields": [b"R", orjson.dumps({"protocol_version": 1})],
    "hello unknown field": [b"H", orjson.dumps({"evil": 1})],
    "abort without ids": [b"X", b"{}"],
    "abort ids not a list": [b"X", orjson.dumps({"request_ids": "r1"})],
    "abort id not a string": [b"X", orjson.dumps({"request_ids": ["r", 5]})],
    "stop choice empty": [b"P", b"{}"],
    "stop choice without index": [b"P", orjson.dumps({"request_id": "r"})],
    "stop choice without request id": [b"P", orjson.dumps({"index": 0})],
    "stop choice index negative": [b"P", orjson.dumps({"request_id": "r", "index": -1})],
    "stop choice index a string": [b"P", orjson.dumps({"request_id": "r", "index": "1"})],
    "stop choice index a bool": [b"P", orjson.dumps({"request_id": "r", "index": True})],
    "stop choice index a float": [b"P", orjson.dumps({"request_id": "r", "index": 1.0})],
    "stop choice index null": [b"P", orjson.dumps({"request_id": "r", "index": None})],
    "stop choice request id not a string": [b"P", orjson.dumps({"request_id": 3, "index": 0})],
    "stop choice payload a list": [b"P", orjson.dumps(["r", 0])],
    "outputs row too short": [b"O", orjson.dumps([["r1"]])],
    "outputs not a list": [b"O", b"5"],
    "error missing message": [b"E", orjson.dumps({"request_id": "r"})],
    "stats gauges not a map": [b"S", orjson.dumps({"gauges": 3})],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_raises_protocol_error(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        P.decode(frames)


BAD_SPELLINGS: list[object] = ["9", [9, 10], [[]], [["9"]], [[-1]], [[True]], [[9] * 33],
                               [[9]] * 65, [[2**31]]]


@pytest.mark.parametrize(
    "params, param",
    [({"temperature": -1.0}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
     ({"top_p": 0}, "top_p"),
     ({"max_tokens": "many"}, "max_tokens"), ({"no_such_knob": 1}, "no_such_knob"),
     ({"stop": [""]}, "stop"),
     # the end tag's spellings: lists of 1..32 token ids, at most 64 of them, beside the end ids
     *(({"reasoning_end_ids": [9, 10], "reasoning_end_spellings": bad}, "reasoning_end_spellings")
       for bad in BAD_SPELLINGS),
     ({"reasoning_end_spellings": [[9]]}, "reasoning_end_spellings")],  # no end ids to spell
)
def test_bad_sampling_params_keep_request_id(params: dict[str, object], param: str) -> None:
    """The engine answers ERROR for the very request, so the decoder must keep its id."""
    with pytest.raises(ProtocolError, match=param) as info:
        P.decode([b"A", _add_payload(params=params)])
    assert info.value.request_id == "r9"


def _random_json(rng: random.Random, depth: int = 0) -> object:
    choices: list[object] = [None, True, -1, 0, 2**40, 1.5, "", "r1", [], {}]
    if depth < 3:
        choices += [[_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]] * 3
        keys = ["request_id", "prompt_token_ids", "params", "gauges", "request_ids", "message",
                "index", "x"]
        choices += [{rng.choice(keys): _random_json(rng, depth + 1)
                     for _ in range(rng.randrange(4))}] * 3
    return rng.choice(choices)


def test_malformed_stop_choice_keeps_request_id() -> None:
    """The engine's ERROR for a bad STOP_CHOICE names the request, so the client fails that
    stream only."""
    with pytest.raises(ProtocolError) as info:
        P.decode([b"P", orjson.dumps({"request_id": "r7", "index": -2})])
    assert info.value.request_id == "r7" and "index" in str(info.value)


def test_fuzz_only_protocol_errors() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        kind = rng.choice([t.value for t in P.MsgType] + [b"?", b"AA"])
        payload = (orjson.dumps(_random_json(rng)) if rng.random() < 0.9
                   else rng.randbytes(rng.randrange(8)))
        with contextlib.suppress(ProtocolError):
            P.decode([kind, payload])
