"""Every way a request ends leaves nothing behind: after each, the engine's RequestTable, its
scheduler's queues and its block manager are empty (every block free, every reference count zero). A
real EngineCore on a tiny random checkpoint, and a real EngineLoop with ZeroMQ clients for the
endings only a loop has (a client aborts, a client goes away)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from engine.core import EngineCore
from engine.loop import EngineLoop
from engine.scheduler import Scheduler
from shared.config import build_config
from shared.constraints import Constraint
from shared.protocol import Abort, Add, Error, Outputs, RequestOutput, decode, encode
from shared.sampling import SamplingParams
from tests.fakes import Stopped, serve_in_thread, smollm2_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
SHAPES = {  # one request of each shape the engine tracks differently
    "plain": ([5, 6, 7, 8, 9], GREEDY),
    "sampled-n2": ([10, 11, 12], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12,
                                                ignore_eos=True)),
    "best-of": ([13, 14, 15, 16], SamplingParams(temperature=0.8, seed=4, n=1, best_of=3,
                                                 max_tokens=8,
                                                 ignore_eos=True)),
    "beams": ([17, 18, 19], SamplingParams(max_tokens=8, use_beam_search=True, beam_width=3, n=2,
                                           ignore_eos=True)),
}


def assert_nothing_left(core: EngineCore) -> None:
    s, bm = core.scheduler, core.block_manager
    assert not core.requests and core.requests.num_compiling == 0, dict(core.requests)
    assert not (s.waiting or s.running or s.swapped) and not core.has_work()
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}
    assert bm.cpu.num_free == bm.cpu.num_blocks


def add_all(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
    for rid, (prompt, params) in requests.items():
        core.add(rid, prompt, params)


def drain(core: EngineCore) -> list[RequestOutput | Error]:
    outs: list[RequestOutput | Error] = []
    for _ in range(2000):
        if not core.has_work():
            return outs
        outs += core.step()
    raise AssertionError("the engine still has work after 2000 steps")


@pytest.fixture
def make_core(tiny_llama_dir: Path) -> Callable[..., EngineCore]:
    def make(**options: object) -> EngineCore:
        return EngineCore(build_config(str(tiny_llama_dir),
                                       **({"num_blocks": 64, "block_size": 8} | options)))
    return make


def test_finished_requests_leave_nothing(make_core: Callable[..., EngineCore]) -> None:
    more = {f"more{i}": ([20 + i] * 30, GREEDY) for i in range(6)}
    # too few blocks for all at once: some are preempted on the way
    for mode in ("swap", "recompute"):
        core = make_core(num_blocks=24, num_cpu_blocks=64, preemption_mode=mode)
        add_all(core, SHAPES | more)
        outs = drain(core)
        assert {o.request_id for o in outs if isinstance(o, RequestOutput)
                and o.finished} == {*SHAPES, *more}
        assert core.stats()[f"num_preemptions_{mode}"] > 0
        assert_nothing_left(core)


def test_aborted_requests_leave_nothing_at_any_step(make_core: Callable[..., EngineCore]) -> None:
    for steps in (0, 1, 3, 6):
        core = make_core()
        add_all(core, SHAPES)
        for _ in range(steps):
            core.step()
        live = set(core.requests)
        outs = core.abort([*SHAPES, "unknown"])
        assert {o.request_id for o in outs} == live
        assert all(isinstance(o, RequestOutput) and o.finish_reason == "abort" for o in outs)
        assert_nothing_left(core)


def test_a_stopped_choice_then_an_abort_leave_nothing(make_core: Callable[..., EngineCore]) -> None:
    core = make_core()
    core.add("n3", [5, 6, 7], SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=40,
                                             ignore_eos=True))
    for _ in range(3):
        core.step()
    assert [o.finish_reason if isinstance(o, RequestOutput) else o
            for o in core.stop_choice("n3", 1)] == ["stop"]
    core.abort(["n3"])
    assert_nothing_left(core)


def test_a_request_whose_step_handling_raises_leaves_nothing(
        make_core: Callable[..., EngineCore], monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core()
    append = Scheduler._append

    def poisoned(self: Scheduler, seq, token, entry) -> None:
        if seq.request.request_id == "plain":
            raise RuntimeError("poisoned append")
        append(self, seq, token, entry)

    monkeypatch.setattr(Scheduler, "_append", poisoned)
    add_all(core, SHAPES)
    outs = drain(core)
    assert [o.request_id for o in outs if isinstance(o, Error)] == ["plain"]
    assert_nothing_left(core)


def test_a_failed_forward_and_the_loops_last_net_leave_nothing(
        make_core: Callable[..., EngineCore], monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core()
    add_all(core, SHAPES)
    core.step()
    execute = core.runner.execute

    def broken(plan: object) -> None:
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(core.runner, "execute", broken)
    failed = core.step()  # every request this step computed ends with an ERROR
    monkeypatch.setattr(core.runner, "execute", execute)
    assert failed and all(isinstance(o, Error) and o.status == 500 for o in failed)
    assert_nothing_left(core)
    add_all(core, SHAPES)
    core.step()
    errors = core.fail_all("a bug outside any request")
    assert {o.request_id for o in errors} == set(SHAPES) and set(errors.clients) == set(SHAPES)
    assert_nothing_left(core)


def test_closing_the_engine_ends_what_is_live(make_core: Callable[..., EngineCore]) -> None:
    core = make_core()
    add_all(core, SHAPES)
    core.step()
    core.close()
    assert_nothing_left(core)


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory, make_tiny_checkpoint) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.e2e.conftest import TINY_CHAT

    folder = tmp_path_factory.mktemp("models") / "tiny-chat"
    make_tiny_checkpoint(folder, LlamaConfig, LlamaForCausalLM, seed=3, **TINY_CHAT)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_grammar_compile_failures_and_aborts_while_compiling_leave_nothing(
        tiny_chat_dir: Path) -> None:
    core = EngineCore(build_config(str(tiny_chat_dir), num_blocks=64, block_size=8))
    try:
        bad = SamplingParams(max_tokens=4, constraint=Constraint("regex", "a(b"))
        good = SamplingParams(temperature=0, max_tokens=6,
                              constraint=Constraint("regex", "(ab|cd){2,4}x"))
        core.add("bad", [1, 5, 7], bad)
        core.add("good", [1, 5, 7], good)
        core.add("aborted", [1, 5, 8],
                 SamplingParams(max_tokens=4, constraint=Constraint("regex", "[0-9]{3,9}y")))
        assert core.requests.num_compiling == 3
        assert [o.request_id for o in core.abort(["aborted"])] == ["aborted"]  # while it compiles
        outs = drain(core)
        errors = [(o.request_id, o.status) for o in outs if isinstance(o, Error)]
        assert errors == [("bad", 400)]
        assert any(o.request_id == "good" and o.finished for o in outs
                   if isinstance(o, RequestOutput))
        assert_nothing_left(core)
    finally:
        core.close()


# ---------------------------------------------------------------- the loop's endings: clients

class Client:
    """A raw DEALER with a fixed identity: what the SDK client sends, without its resume logic."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, identity: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.outputs: dict[str, list[RequestOutput | Error]] = {}

    def send(self, msg: Add | Abort) -> None:
        self.sock.send_multipart(encode(msg))

    def wait_for(self, done: Callable[[dict[str, list[RequestOutput | Error]]], bool],
                 timeout: float = 60) -> None:
        """Read outputs until done(outputs so far), or fail at the deadline."""
        deadline = time.monotonic() + timeout
        while not done(self.outputs):
            assert time.monotonic() < deadline, f"timed out; got {self.outputs}"
            if self.sock.poll(100):
                msg = decode(self.sock.recv_multipart())
                outs = (msg.outputs if isinstance(msg, Outputs)
                        else [msg] if isinstance(msg, Error) else [])
                for out in outs:
                    assert out.request_id is not None
                    self.outputs.setdefault(out.request_id, []).append(out)


def ended(rid: str) -> Callable[[dict[str, list[RequestOutput | Error]]], bool]:
    return lambda outs: any(isinstance(o, Error) or o.finished for o in outs.get(rid, []))


@pytest.fixture
def serving(make_core: Callable[..., EngineCore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[tuple[EngineLoop, zmq.Context[zmq.Socket[bytes]]]]:
    core = make_core()
    loop = EngineLoop(core, f"ipc://{tmp_path}/engine.sock")
    stop = threading.Event()
    has_work = core.has_work

    def until_stopped() -> bool:
        if stop.is_set():
            raise Stopped
        return has_work()

    monkeypatch.setattr(core, "has_work", until_stopped)

    thread = serve_in_thread(loop)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield loop, ctx
    finally:
        stop.set()
        thread.join(30)
        ctx.destroy(linger=0)
    assert not thread.is_alive()


def test_client_aborts_and_a_client_that_goes_leave_nothing(
        serving: tuple[EngineLoop, zmq.Context[zmq.Socket[bytes]]],
        caplog: pytest.LogCaptureFixture) -> None:
    loop, ctx = serving
    core = loop.core
    a, b = Client(ctx, loop.address, b"client-a"), Client(ctx, loop.address, b"client-b")
    for rid in ("a1", "a2", "a3"):
        a.send(Add(rid, [5, 6, 7, 8], LONG))
    b.send(Add("b1", [9, 10, 11], LONG))
    b.send(Add("b2", [12, 13], GREEDY))
    b.send(Abort(["a2"]))  # not its request: ignored
    a.send(Abort(["a1"]))
    a.wait_for(lambda outs: ended("a1")(outs) and "a2" in outs and "a3" in outs)
    assert [o.finish_reason if isinstance(o, RequestOutput) else o
            for o in a.outputs["a1"] if o.request_id == "a1"][-1] == "abort"
    assert not ended("a2")(a.outputs)
    b.wait_for(ended("b2"))
    with caplog.at_level(logging.WARNING, logger="conveyor.loop"):
        # client a goes: the loop finds out on its next send, and aborts a2, a3
        a.sock.close(linger=0)
        b.send(Abort(["b1"]))
        b.wait_for(ended("b1"))
        deadline = time.monotonic() + 60
        while core.requests or "is gone; aborting its 2 requests" not in caplog.text:
            assert time.monotonic() < deadline, (dict(core.requests), caplog.text)
            b.sock.poll(50)  # a pause that wakes on any message to b
    assert [o.finish_reason for o in b.outputs["b1"] if isinstance(o, RequestOutput)][-1] == "abort"
    b.sock.close(linger=0)
    assert_nothing_left(core)
