"""Structured output in the engine: grammars compiled off the step, a matcher per
sequence, masks on the logits.

Library: xgrammar (docs/structured_output.md says why, with the figures that chose it over
llguidance).

Life of a constrained request:
1. `EngineCore.add` asks `Grammars.compile` for its grammar, compiled in a worker process
   (engine/grammar_worker.py; compiled grammars are cached by their text, and a second request for a
   grammar being compiled waits on the same future). The request waits in the engine's RequestTable
   (engine/requests.py) with that future, in no scheduler queue, holding no blocks: the step never
   waits for a compile. A compile has a time and a memory budget (over either, the request gets a
   400), and it is killed (`Grammars.release`) when every request waiting for it is aborted.
2. Each step, `Grammars.ready` takes the finished compiles: an invalid schema, regex or grammar is
   an ERROR with status 400 and the compiler's message (nothing was queued); a valid one gives its
   matcher to the root sequence, which goes to the scheduler.
3. The sampler calls `apply_masks` on its logits: one bitmask row per constrained sequence, filled
   by its matcher and applied in place (a masked token's logit becomes -inf). Stop tokens are in the
   mask exactly when the grammar can end.
4. The scheduler, the one writer of tokens, advances the matcher with each token it appends
   (`advance`); a sequence whose grammar has ended is finished ("stop").

Invariant: a sequence's matcher has consumed exactly its output tokens. Forks (n, best_of) copy the
state (`Sequence.fork`); preemption keeps every token (swap and recompute alike recompute K/V only),
so the state is kept too; constrained requests never speculate (engine/speculative `can_speculate`),
so no token is ever taken back, and beam search with a constraint is refused (shared/sampling.py).
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent import futures
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.grammar_worker import read_frame, write_frame
from shared.constraints import Constraint

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.sequence import Sequence

log = logging.getLogger("conveyor.structured")

CACHE_SIZE = 256  # compiled grammars kept, least recently used evicted
COMPILE_TIMEOUT = 20.0  # seconds a compile may take (real schemas take well under one)
COMPILE_MEMORY = 1 << 30  # bytes of memory a compile may add to its process
COMPILE_WORKERS = 2  # compiles at once: a slow one holds one, the others go on


class GrammarError(Exception):
    """The client's schema, regex or grammar does not compile, or not within the budget: for a
    400."""


class _CompileServer:
    """The engine's end of engine/grammar_worker.py: jobs out on its stdin, answers read by a thread
    of their own, each resolving its job's future. Started on first use."""

    def __init__(self, info: xgr.TokenizerInfo, workers: int, timeout: float,
                 max_bytes: int) -> None:
        self.info = info
        argv = [sys.executable, "-m", "engine.grammar_worker", str(workers), str(timeout),
                str(max_bytes)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.jobs: dict[int, Future[xgr.CompiledGrammar]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # writes to its stdin, and self.jobs
        self._send(info.serialize_json().encode())
        threading.Thread(target=self._read, name="grammar-answers", daemon=True).start()

    def _send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            write_frame(self.proc.stdin, data)

    def submit(self, c: Constraint) -> tuple[int, Future[xgr.CompiledGrammar]]:
        job_id, future = next(self._ids), Future[Any]()
        with self._lock:
            self.jobs[job_id] = future
        self._send(json.dumps({"id": job_id, "kind": c.kind, "value": c.value}).encode())
        return job_id, future

    def cancel(self, job_id: int) -> None:
        with self._lock:
            self.jobs.pop(job_id, None)
        self._send(json.dumps({"id": job_id, "cancel": True}).encode())

    def _read(self) -> None:
        import xgrammar as xgr

        out = self.proc.stdout
        assert out is not None
        try:
            while True:
                head = json.loads(read_frame(out))
                payload = read_frame(out) if head["error"] is None else b""
                with self._lock:
                    future = self.jobs.pop(head["id"], None)
                if future is None:  # cancelled meanwhile
                    continue
                if head["error"] is not None:
                    future.set_exception(GrammarError(head["error"]))
                else:
                    grammar = xgr.CompiledGrammar.deserialize_json(payload.decode(), self.info)
                    future.set_result(grammar)
        except (EOFError, OSError, ValueError) as e:
            with self._lock:
                jobs, self.jobs = self.jobs, {}
            for future in jobs.values():
                future.set_exception(RuntimeError("the grammar compile server exited "
                                                  f"({e or 'EOF'})"))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # it kills its children and exits
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Grammars:
    """Compiles constraints in a compile server process (engine/grammar_worker.py: a forked child
    per compile, killable, with a time and a memory budget) and caches the results by text. The
    requests that wait for a compile wait in EngineCore's RequestTable; a compile whose requests all
    went away is killed. `load_tokenizer` runs once, on the first constrained request."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 stop_token_ids: tuple[int, ...], max_workers: int = COMPILE_WORKERS,
                 timeout: float = COMPILE_TIMEOUT, max_bytes: int = COMPILE_MEMORY) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_workers, self.timeout, self.max_bytes = max_workers, timeout, max_bytes
        self._server: _CompileServer | None = None
        self._starting: Future[_CompileServer] | None = None  # the first use starts it, in a thread
        self._cache: OrderedDict[Constraint, tuple[int, Future[xgr.CompiledGrammar]]]
        self._cache = OrderedDict()
        # before the server is up
        self._pending: list[tuple[Constraint, Future[xgr.CompiledGrammar]]] = []
        self.stats = {"grammar_compiles": 0, "grammar_cache_hits": 0,
                      "grammar_compiles_cancelled": 0}

    # ---------------------------------------------------------------- requests
    def release(self, future: Future[xgr.CompiledGrammar]) -> None:
        """No request waits for future any more (the last one was aborted): a compile still
        running is killed, its process with it. The caller (EngineCore, from its
        RequestTable) knows who waits."""
        if future.done():
            return
        key = next((c for c, (_, f) in self._cache.items() if f is future), None)
        if key is None:
            return
        job_id, _ = self._cache.pop(key)
        self.stats["grammar_compiles_cancelled"] += 1
        if job_id >= 0 and self._server is not None:
            self._server.cancel(job_id)
        else:
            self._pending = [(c, f) for c, f in self._pending if f is not future]

    @staticmethod
    def wait(waiting: Iterable[Future[xgr.CompiledGrammar]], timeout: float) -> None:
        """Until one of the waiting compiles finishes, or timeout seconds."""
        futures.wait(list(waiting), timeout, futures.FIRST_COMPLETED)

    def ready(self, waiting: dict[str, Future[xgr.CompiledGrammar]]
              ) -> tuple[list[tuple[str, xgr.GrammarMatcher]], list[tuple[str, str, int]]]:
        """Of waiting (request id -> its compile), those whose compile finished: (request id, its
        matcher) for those ready to schedule, (request id, why, HTTP status) for the others: 400
        when the constraint does not compile (or not within the budget), 500 when the engine could
        not compile anything. Never blocks."""
        self._flush_pending()
        ok: list[tuple[str, xgr.GrammarMatcher]] = []
        failed: list[tuple[str, str, int]] = []
        for rid, future in waiting.items():
            if not future.done():
                continue
            try:
                ok.append((rid, self.matcher(future.result())))
            except GrammarError as e:
                failed.append((rid, str(e), 400))
            # BLE001: answered to the request, never raised into the step
            except Exception as e:  # every waiting request hears it (a 500)
                log.exception("request %s: its grammar could not be compiled", rid)
                failed.append((rid, f"the engine could not compile this request's constraint: "
                                    f"{type(e).__name__}: {e}", 500))
        return ok, failed

    # ---------------------------------------------------------------- compiling
    def compile(self, constraint: Constraint) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of constraint, from the cache or a new compile in the compile
        server."""
        hit = self._cache.get(constraint)
        if hit is not None and not (hit[1].done() and hit[1].exception() is not None):
            self._cache.move_to_end(constraint)
            self.stats["grammar_cache_hits"] += 1
            return hit[1]
        self.stats["grammar_compiles"] += 1
        self._flush_pending()
        if self._server is None:
            future: Future[xgr.CompiledGrammar] = Future()
            self._pending.append((constraint, future))
            self._cache[constraint] = (-1, future)
            self._start_server()
        else:
            self._cache[constraint] = self._server.submit(constraint)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return self._cache[constraint][1]

    def _start_server(self) -> None:
        """The tokenizer's info for xgrammar and the compile server, built in a thread on first
        use."""
        if self._starting is not None:
            return

        def start() -> _CompileServer:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(),
                                                      vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            return _CompileServer(info, self.max_workers, self.timeout, self.max_bytes)

        self._starting = Future()
        starting = self._starting

        def run() -> None:
            try:
                starting.set_result(start())
            except Exception as e:
                log.exception("the grammar compile server did not start")
                starting.set_exception(e)

        threading.Thread(target=run, name="grammar-start", daemon=True).start()

    def _flush_pending(self) -> None:
        """Once the server is up, the compiles asked for meanwhile go to it (called from the
        loop)."""
        if self._server is not None or self._starting is None or not self._starting.done():
            return
        error = self._starting.exception()
        pending, self._pending = self._pending, []
        if error is not None:
            self._starting = None  # the next constrained request tries again
            for c, f in pending:
                self._cache.pop(c, None)
                f.set_exception(error)
            return
        self._server = self._starting.result()
        for c, f in pending:
            job_id, real = self._server.submit(c)
            self._cache[c] = (job_id, f)  # the requests wait on f: drop() finds the job by it
            real.add_done_callback(functools.partial(_copy, dst=f))

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


def _copy(src: Future[Any], dst: Future[Any]) -> None:
    if dst.done():
        return
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


# -------------------------------------------------------------------- the step's side

# byte -> the penalties of its 8 tokens, least significant bit first (xgrammar's bit order):
# [256, 8]
_PENALTY = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                  bitorder="little") == 1, np.float32(0.0),
                    np.float32(-np.inf)).astype(np.float32)


def advance(seq: Sequence, token: int) -> bool:
    """seq's matcher takes the token it just appended. -> True when the grammar has
    ended (the sequence stops). Raises when the token breaks the grammar: a bug, which
    fails this request only."""
    m = seq.matcher
    assert m is not None
    if not m.accept_token(token):
        raise RuntimeError(f"token {token} is not allowed by the request's grammar")
    return bool(m.is_terminated())


def apply_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: logits[i, t] = -inf for every token t the grammar of seqs[i] does not allow next.
    Rows without a matcher are untouched. Idempotent, so sampling the same rows again (the runner's
    one-by-one retry) gives the same result. logits: [B, V] float32 on the CPU or a device."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)  # [R, ceil(V / 32)] int32, every bit set
    for j, i in enumerate(rows):
        m = seqs[i].matcher
        assert m is not None
        m.fill_next_token_bitmask(bitmask, j)
    # Each mask byte looks up its 8 penalties (0 allowed, -inf not): one gather and one add, without
    # branches, several times faster on the CPU than masked_fill on a mask with many transitions
    # (docs/structured_output.md).
    rows_bytes = bitmask.numpy().view(np.uint8)  # [R, ceil(V / 32) * 4]
    # [R, V] float32
    penalty = torch.from_numpy(_PENALTY[rows_bytes].reshape(len(rows), -1)[:, :vocab])
    penalty = penalty.to(logits.device, logits.dtype)
    if len(rows) == logits.shape[0]:
        logits.add_(penalty)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), penalty)
