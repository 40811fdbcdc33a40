"""Test doubles for the client side: a fake engine that speaks shared/protocol.py, and the default
model's tokenizer loaded once per test session into a temporary cache (never ~/.cache)."""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from shared import protocol as P
from shared.errors import ProtocolError


def cache_root() -> Path:
    """CONVEYOR_CACHE for this test process and its children: tests/conftest.py points it at a
    session temp folder; run without that conftest, a private temp folder is made here."""
    if "CONVEYOR_CACHE" not in os.environ:
        path = tempfile.mkdtemp(prefix="conveyor-test-cache-")
        atexit.register(shutil.rmtree, path, True)
        os.environ["CONVEYOR_CACHE"] = path
    return Path(os.environ["CONVEYOR_CACHE"])


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """Parsed from the GGUF once per session (seconds), then cached where subprocesses
    find it too."""
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    source = resolve_model("SmolLM2-135M-Instruct")
    return load_tokenizer(source, cache_dir=cache_root() / source.cache_dir.name)


def fake_logprobs(token_id: int, position: int, k: int) -> list[Any]:
    """The logprobs entry FakeEngine sends for the token at `position` of a choice: the sampled
    token is the most likely, then k - 1 made-up neighbours, each one nat less likely."""
    lp = -0.25 * (position + 1)
    return [lp, [[token_id + j, lp - j] for j in range(k)]]


class FakeEngine:
    """A ROUTER in a thread. Every request emits `tokens` (or `script(add)`), `tokens_per_step` per
    step, finishing with "length" at max_tokens or "stop" when the script runs out. With n > 1,
    choice i emits `choices(add)[i]` (default: the script's tokens for every choice), in lockstep,
    the row that ends the last one finishing the request. Rows carry fake_logprobs() when the
    request asks for logprobs. `reject(add)` returning a message makes the engine answer ERROR
    instead. Everything received is kept in `received`."""

    def __init__(self, tokens: list[int] | None = None, *, address: str | None = None,
                 answer_hello: bool = True, model_name: str = "SmolLM2-135M-Instruct",
                 max_model_len: int = 256, step_interval: float = 0.002, tokens_per_step: int = 1,
                 script: Callable[[P.Add], list[int]] | None = None,
                 choices: Callable[[P.Add], list[list[int]]] | None = None,
                 reject: Callable[[P.Add], str | None] | None = None) -> None:
        self.tokens = tokens if tokens is not None else [100, 200, 300]
        self.answer_hello = answer_hello
        self.step_interval, self.tokens_per_step = step_interval, tokens_per_step
        self.ready = P.Ready(P.PROTOCOL_VERSION, model_name, max_model_len)
        self.script = script or (lambda add: list(self.tokens))
        self.choices = choices or (lambda add: [self.script(add) for _ in range(add.params.n)])
        self.reject = reject or (lambda add: None)
        self.received: list[P.Message] = []
        self.aborted: list[str] = []
        # (request id, index) of STOP_CHOICE messages
        self.stopped_choices: list[tuple[str, int]] = []
        self._ctx = zmq.Context()
        self._ctx.linger = 0
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if address is None:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
        else:
            self._sock.bind(address)
        self.address = address
        # request_id -> [client identity, Add, remaining tokens per choice, emitted
        # count per choice]
        self._live: dict[str, list[Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._ctx.destroy(linger=0)

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(0.005)
        return pred()

    def adds(self) -> list[P.Add]:
        return [m for m in self.received if isinstance(m, P.Add)]

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(int(self.step_interval * 1000) if self._live else 20):
                while self._sock.poll(0):
                    ident, *frames = self._sock.recv_multipart()
                    self._handle(ident, frames)
            if self._live:
                self._step()

    def _send(self, ident: bytes, msg: P.Message) -> None:
        self._sock.send_multipart([ident, *P.encode(msg)])

    def _handle(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            msg = P.decode(frames)
        except ProtocolError as e:
            self._send(ident, P.Error(e.request_id, str(e)))
            return
        self.received.append(msg)
        if isinstance(msg, P.Hello) and self.answer_hello:
            self._send(ident, self.ready)
        elif isinstance(msg, P.GetStats):
            self._send(ident, P.Stats({"num_running": float(len(self._live))}))
        elif isinstance(msg, P.Add):
            why = self.reject(msg)
            if why is not None:
                self._send(ident, P.Error(msg.request_id, why, 400))
            else:
                n = msg.params.n
                script = self.choices(msg)[:n] if n > 1 else [self.script(msg)]
                self._live[msg.request_id] = [ident, msg, [list(t) for t in script],
                                              [0] * len(script)]
        elif isinstance(msg, P.StopChoice):
            self._stop_choice(msg.request_id, msg.index)
        elif isinstance(msg, P.Abort):
            for rid in msg.request_ids:
                self.aborted.append(rid)
                entry = self._live.pop(rid, None)
                if entry is not None:
                    row = P.RequestOutput(rid, [], True, "abort", len(entry[1].prompt_token_ids))
                    self._send(entry[0], P.Outputs([row]))

    def _stop_choice(self, rid: str, index: int) -> None:
        """As the engine: the choice ends with a "stop" row, which ends the request if it
        was the last."""
        self.stopped_choices.append((rid, index))
        entry = self._live.get(rid)
        if entry is None or index >= len(entry[2]) or entry[2][index] is None:
            return
        entry[2][index] = None
        done = all(r is None for r in entry[2])
        if done:
            del self._live[rid]
        self._send(entry[0], P.Outputs([P.RequestOutput(rid, [], done, "stop",
                                                        len(entry[1].prompt_token_ids),
                                                        index=index)]))

    def _step(self) -> None:
        per_client: dict[bytes, list[P.RequestOutput]] = {}
        for rid, (ident, add, remaining, emitted) in list(self._live.items()):
            rows = per_client.setdefault(ident, [])
            k = add.params.logprobs
            for i, left in enumerate(remaining):
                if left is None:
                    continue  # this choice has ended
                room = add.params.max_tokens - emitted[i]
                cut = min(self.tokens_per_step, room)
                new, remaining[i] = left[:cut], left[cut:]
                lps = None if k is None else [fake_logprobs(t, emitted[i] + j, k)
                                              for j, t in enumerate(new)]
                emitted[i] += len(new)
                reason = ("length" if emitted[i] >= add.params.max_tokens
                          else "stop" if not remaining[i] else None)
                if reason is not None:
                    remaining[i] = None
                done = all(r is None for r in remaining)
                rows.append(P.RequestOutput(rid, new, done, reason, len(add.prompt_token_ids),
                                            logprobs=lps, index=i))
            if all(r is None for r in remaining):
                del self._live[rid]
        # one OUTPUTS message per client per step, as the engine does
        for ident, outs in per_client.items():
            self._send(ident, P.Outputs(outs))


class Stopped(Exception):
    """Raised inside a test's engine loop (from a patched has_work or step) to end
    EngineLoop.run."""


def serve_in_thread(loop: Any) -> threading.Thread:
    """loop.run() on a daemon thread, started; a Stopped raised inside it ends it quietly."""
    def serve() -> None:
        with contextlib.suppress(Stopped):
            loop.run()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread
