"""The wire between clients (gateway, SDK) and the engine.

A message is two ZeroMQ frames: a one-byte type frame and an orjson payload. The engine's
ROUTER socket adds the client identity in front. Never pickle: anyone who reaches the socket
must not be able to run code here.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from shared.embedding import PoolingParams
from shared.errors import ConveyorError, ProtocolError
from shared.sampling import SamplingParams, check_priority

# 2: ABORT may name one choice (index). 3: ending one choice is its own message, STOP_CHOICE; ABORT
# ends whole requests only, so one message no longer has two meanings; ADD no longer carries the
# client's arrival_time (the engine orders by its own clock at receipt). 4: HEARTBEAT (engine ->
# client while it has requests in flight), and READY announces the engine's message size limit and
# heartbeat. OBSERVE/OBSERVED and TRACE/TRACE_DATA (the dashboard, traces) were added without a
# version change: they are optional, and an engine that predates them answers an ERROR, which costs
# a client nothing else.
# 5: SamplingParams.prompt_logprobs (every ADD carries it, so an older engine would refuse every
# request), and OUTPUTS rows end with prompt_logprobs; embeddings: ADD may carry `pooling`, READY
# announces the engine's pooler, an output row its `embedding` (an engine of 4 would have generated
# text for one).
# 6: HELLO no longer names the client and READY no longer lists the eos ids (nobody read either).
# 7: SamplingParams.reasoning_start_ids, reasoning_end_ids and thinking_token_budget (an engine of 6
# refuses every request of a reasoning server, which carries them).
# 8: SamplingParams.reasoning_end_spellings (every ADD carries it, so an engine of 7 would refuse
# every request).
PROTOCOL_VERSION = 8


class MsgType(bytes, enum.Enum):
    HELLO = b"H"
    READY = b"R"
    ADD = b"A"
    ABORT = b"X"
    STOP_CHOICE = b"P"
    OUTPUTS = b"O"
    ERROR = b"E"
    STATS = b"S"
    GET_STATS = b"G"
    RESET_PREFIX_CACHE = b"C"
    HEARTBEAT = b"B"
    OBSERVE = b"V"
    OBSERVED = b"W"
    TRACE = b"T"
    TRACE_DATA = b"D"


@dataclass(slots=True)
class Hello:
    """Client -> engine: first message; the engine answers READY (or ERROR: another protocol
    version)."""

    protocol_version: int = PROTOCOL_VERSION


@dataclass(slots=True)
class Ready:
    """Engine -> client: the handshake answer, with what a client needs to validate requests."""

    protocol_version: int
    model_name: str
    max_model_len: int
    # The largest message the engine takes (ZeroMQ drops the connection of a client that sends more:
    # the SDK refuses such a request itself); 0 = not announced.
    max_message_size: int = 0
    # Seconds between HEARTBEATs while this client has requests in flight; 0 = the engine sends none
    # (the client then does not watch for silence).
    heartbeat_interval: float = 0.0
    # What the engine's pooler does (shared/embedding.py PoolingInfo.to_dict); None: it cannot pool.
    pooling: dict[str, Any] | None = None


@dataclass(slots=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    pooling: PoolingParams | None = None  # an embedding request: pool the prompt, sample nothing


@dataclass(slots=True)
class Abort:
    """Client -> engine: end these whole requests (unknown or finished ids are ignored)."""

    request_ids: list[str]


@dataclass(slots=True)
class StopChoice:
    """Client -> engine: end one choice (sequence) of an n > 1 request, because a stop string ended
    it in the client while the other choices go on. The engine answers with that choice's "stop"
    row, which finishes the request when it was the last choice running."""

    request_id: str
    index: int


@dataclass(slots=True)
class RequestOutput:
    """One request's delta from one step: only the tokens that are new since the last output."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # On the final output only: engine-stamped wall-clock times (queued, scheduled, first_token,
    # finished) and the preemption count, so clients compute latencies from the engine's clock.
    events: dict[str, float] | None = None
    # Per new token, when the request asked for logprobs: [logprob, [[token id, logprob], ...top
    # k]], the raw model's log_softmax (before penalties and temperature).
    logprobs: list[list[Any]] | None = None
    # Which of the request's sequences these tokens extend (n / best_of / beam search; 0 otherwise).
    # finish_reason ends that sequence; finished ends the request (its last sequence).
    index: int = 0
    # On the request's first row, when it asked for prompt_logprobs: one entry per prompt token, the
    # first None, then [logprob, rank (1 = most likely), [[token id, logprob], ...top k]]
    # (engine/prompt_logprobs.py).
    prompt_logprobs: list[Any] | None = None
    # An embedding request's vector (shared/embedding.py), on its one (final) output.
    embedding: list[float] | None = None


@dataclass(slots=True)
class Outputs:
    outputs: list[RequestOutput]


@dataclass(slots=True)
class Error:
    """A request (or, with request_id None, a message) the engine could not take."""

    request_id: str | None
    message: str
    status: int = 400


@dataclass(slots=True)
class GetStats:
    pass


@dataclass(slots=True)
class ResetPrefixCache:
    """Client -> engine: forget every cached prefix. No answer."""


@dataclass(slots=True)
class Stats:
    """Scheduler and cache gauges; a flat name -> number map so new gauges need no protocol
    change."""

    gauges: dict[str, float]


@dataclass(slots=True)
class Heartbeat:
    """Engine -> client, at most every Ready.heartbeat_interval while the client has requests in
    flight: the engine is alive and stepping. A client that hears nothing at all for longer than its
    timeout treats the engine as lost (frozen, or its host gone without closing the connection)."""


@dataclass(slots=True)
class Observe:
    """Client -> engine: send me OBSERVED messages for the next `seconds` (at most 10; 0
    stops). A watcher renews it while it wants more, so a client that vanished stops costing
    the engine anything soon."""

    seconds: float


@dataclass(slots=True)
class Observed:
    """Engine -> a client that OBSERVEs, at most every 0.1 s: the steps since the last one, one row
    each [step, wall time, prefill tokens, decode tokens, sequences, seconds, preempted, blocks
    swapped out, blocks swapped in, tokens sampled]; a snapshot of the queues and KV blocks (at most
    every 0.2 s, else None; its layout: engine/observe/dashboard.py); and latency samples in seconds
    (TTFT of requests that finished, inter-token gaps)."""

    steps: list[list[float]]
    snapshot: dict[str, Any] | None
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Trace:
    """Client -> engine: on, start recording a trace of steps and request lifecycles
    (engine/observe/trace.py); off, stop and answer TRACE_DATA with it."""

    on: bool


@dataclass(slots=True)
class TraceData:
    """Engine -> client: the answer to TRACE off, a Chrome trace-event JSON object."""

    trace: dict[str, Any]


Message = (Hello | Ready | Add | Abort | StopChoice | Outputs | Error | GetStats | Stats
           | ResetPrefixCache | Heartbeat | Observe | Observed | Trace | TraceData)

_TYPES: dict[type, MsgType] = {
    Hello: MsgType.HELLO,
    Ready: MsgType.READY,
    Add: MsgType.ADD,
    Abort: MsgType.ABORT,
    StopChoice: MsgType.STOP_CHOICE,
    Outputs: MsgType.OUTPUTS,
    Error: MsgType.ERROR,
    GetStats: MsgType.GET_STATS,
    Stats: MsgType.STATS,
    ResetPrefixCache: MsgType.RESET_PREFIX_CACHE,
    Heartbeat: MsgType.HEARTBEAT,
    Observe: MsgType.OBSERVE,
    Observed: MsgType.OBSERVED,
    Trace: MsgType.TRACE,
    TraceData: MsgType.TRACE_DATA,
}


def encode(msg: Message) -> list[bytes]:
    """-> [type frame, orjson payload]."""
    if isinstance(msg, Add):
        payload: Any = {
            "request_id": msg.request_id,
            "prompt_token_ids": msg.prompt_token_ids,
            "params": msg.params.to_dict(),
            "priority": msg.priority,
            **({"pooling": msg.pooling.to_dict()} if msg.pooling is not None else {}),
        }
    elif isinstance(msg, Outputs):
        # Positional rows: one OUTPUTS message per client per step carries many deltas.
        payload = [
            [o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.num_prompt_tokens,
             o.num_cached_tokens, o.events, o.logprobs, o.index, o.prompt_logprobs, o.embedding]
            for o in msg.outputs
        ]
    elif isinstance(msg, Observed):  # asdict would deep-copy the block map first
        payload = [msg.steps, msg.snapshot, msg.ttft, msg.itl]
    elif isinstance(msg, TraceData):
        payload = msg.trace
    else:
        payload = asdict(msg)
    return [_TYPES[type(msg)].value, orjson.dumps(payload)]


def decode(frames: list[bytes]) -> Message:
    """Inverse of encode. Any malformed input raises ProtocolError, never anything else."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    data: Any = None
    try:
        kind = MsgType(bytes(frames[0]))
        data = orjson.loads(frames[1])
        return _DECODERS[kind](data)
    except Exception as e:  # every decoding failure becomes one typed error
        rid = data.get("request_id") if isinstance(data, dict) else None
        malformed = f"malformed message: {type(e).__name__}: {e}"
        why = str(e) if isinstance(e, ConveyorError) else malformed
        raise ProtocolError(why, request_id=rid if isinstance(rid, str) else None) from None


def _decode_add(d: dict[str, Any]) -> Add:
    ids = d["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ProtocolError("prompt_token_ids must be a non-empty list of non-negative integers")
    if not isinstance(d["request_id"], str):
        raise ProtocolError("request_id must be a string")
    return Add(
        request_id=d["request_id"],
        prompt_token_ids=ids,
        params=SamplingParams.from_dict(d["params"]),
        priority=check_priority(d.get("priority", 0)),
        pooling=PoolingParams.from_dict(d["pooling"]) if d.get("pooling") is not None else None,
    )


_NUM_OUTPUT_FIELDS = len(RequestOutput.__dataclass_fields__)


def _output_row(row: list[Any]) -> RequestOutput:
    """Rows may carry fields this reader does not know yet (appended at the end): ignore them.
    Slicing only then saves a third of the time per row (a few hundred rows per engine step)."""
    if len(row) == _NUM_OUTPUT_FIELDS:
        return RequestOutput(*row)
    return RequestOutput(*row[:_NUM_OUTPUT_FIELDS])


def _decode_hello(d: dict[str, Any]) -> Hello:
    """Another version's HELLO is read for its version only, so the engine can answer that they
    differ."""
    version = d.get("protocol_version", PROTOCOL_VERSION)
    if version == PROTOCOL_VERSION and d.keys() - {"protocol_version"}:
        raise ProtocolError("HELLO takes only protocol_version")
    return Hello(version)


def _decode_abort(d: dict[str, Any]) -> Abort:
    ids = d["request_ids"]
    if not isinstance(ids, list) or not all(isinstance(r, str) for r in ids):
        raise ProtocolError("request_ids must be a list of strings")
    return Abort(ids)


def _decode_stop_choice(d: dict[str, Any]) -> StopChoice:
    rid, index = d["request_id"], d["index"]
    if not isinstance(rid, str):
        raise ProtocolError("request_id must be a string")
    if type(index) is not int or index < 0:  # type(), not isinstance: True is not choice 1
        raise ProtocolError(f"index must be a non-negative integer, not {index!r}")
    return StopChoice(rid, index)


def _seconds(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < float("inf"):
        raise ProtocolError(f"seconds must be a non-negative number, not {v!r}")
    return float(v)


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"on must be true or false, not {v!r}")
    return v


_DECODERS: dict[MsgType, Callable[[Any], Message]] = {
    MsgType.HELLO: _decode_hello,
    MsgType.READY: lambda d: Ready(**d),
    MsgType.ADD: _decode_add,
    MsgType.ABORT: _decode_abort,
    MsgType.STOP_CHOICE: _decode_stop_choice,
    MsgType.OUTPUTS: lambda rows: Outputs([_output_row(row) for row in rows]),
    MsgType.ERROR: lambda d: Error(**d),
    MsgType.GET_STATS: lambda d: GetStats(),
    MsgType.STATS: lambda d: Stats(gauges=dict(d["gauges"])),
    MsgType.RESET_PREFIX_CACHE: lambda d: ResetPrefixCache(),
    MsgType.HEARTBEAT: lambda d: Heartbeat(),
    MsgType.OBSERVE: lambda d: Observe(_seconds(d["seconds"])),
    MsgType.OBSERVED: lambda d: Observed(*d),
    MsgType.TRACE: lambda d: Trace(_flag(d["on"])),
    MsgType.TRACE_DATA: lambda d: TraceData(dict(d)),
}
