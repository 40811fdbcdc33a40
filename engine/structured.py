"""Structured output in the engine: grammars compiled off the step, a matcher per sequence, masks on the logits.

Library: xgrammar (docs/structured_output.md says why, with the figures that chose it over llguidance).

Life of a constrained request:
1. `EngineCore.add` hands it to `Grammars.add`: its grammar is compiled in a worker thread (compiled
   grammars are cached by their text, and a second request for a grammar being compiled waits on the same
   future). The request waits here, in no scheduler queue, holding no blocks: the step never waits for a
   compile.
2. Each step, `Grammars.ready` takes the finished compiles: an invalid schema, regex or grammar is an
   ERROR with status 400 and the compiler's message (nothing was queued); a valid one gives the root
   sequence its matcher and goes to the scheduler.
3. The sampler calls `apply_masks` on its logits: one bitmask row per constrained sequence, filled by
   its matcher and applied in place (a masked token's logit becomes -inf). Stop tokens are in the mask
   exactly when the grammar can end.
4. The scheduler, the one writer of tokens, advances the matcher with each token it appends
   (`advance`); a sequence whose grammar has ended is finished ("stop").

Invariant: a sequence's matcher has consumed exactly its output tokens. Forks (n, best_of) copy the
state (`Sequence.fork`); preemption keeps every token (swap and recompute alike recompute K/V only),
so the state is kept too; constrained requests never speculate (engine/spec `can_speculate`), so no
token is ever taken back, and beam search with a constraint is refused (shared/sampling.py).
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shared.constraints import Constraint

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.sequence import Sequence

log = logging.getLogger("conveyor.structured")

CACHE_SIZE = 256  # compiled grammars kept, least recently used evicted
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[17:18:13] /project/cpp/x.cc:83: " before a message


class GrammarError(Exception):
    """The client's schema, regex or grammar does not compile: the compiler's message, for a 400."""


class Grammars:
    """Compiles constraints in a worker thread, caches the results by text, and holds the requests that
    wait for theirs. `load_tokenizer` runs once, in the worker, on the first constrained request."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_workers: int = 1) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Future[xgr.CompiledGrammar]] = OrderedDict()
        self.waiting: dict[str, tuple[Sequence, Future[xgr.CompiledGrammar]]] = {}  # by request id
        self.stats = {"grammar_compiles": 0, "grammar_cache_hits": 0}

    # ---------------------------------------------------------------- requests
    def add(self, root: Sequence) -> None:
        constraint = root.params.constraint
        assert constraint is not None
        self.waiting[root.request.request_id] = (root, self.compile(constraint))

    def drop(self, request_id: str) -> bool:
        """An abort of a request still waiting for its grammar. -> whether it was here."""
        return self.waiting.pop(request_id, None) is not None

    def wait(self, timeout: float) -> None:
        """Until a waiting request's compile finishes, or timeout seconds."""
        futures.wait([f for _, f in self.waiting.values()], timeout, futures.FIRST_COMPLETED)

    def ready(self) -> tuple[list[Sequence], list[tuple[str, str, int]]]:
        """The waiting requests whose compile finished: (roots with their matcher, ready to schedule),
        (request id, why, HTTP status) for the others: 400 when the constraint does not compile, 500 when
        the engine could not compile anything (its tokenizer did not load). Never blocks."""
        ok: list[Sequence] = []
        failed: list[tuple[str, str, int]] = []
        for rid in [rid for rid, (_, f) in self.waiting.items() if f.done()]:
            root, future = self.waiting.pop(rid)
            try:
                root.matcher = self.matcher(future.result())
            except GrammarError as e:
                failed.append((rid, str(e), 400))
                continue
            except Exception as e:  # noqa: BLE001 - answered to the request, never raised into the step
                log.exception("request %s: its grammar could not be compiled", rid)
                failed.append((rid, f"the engine could not compile this request's constraint: "
                                    f"{type(e).__name__}: {e}", 500))
                continue
            ok.append(root)
        return ok, failed

    # ---------------------------------------------------------------- compiling
    def compile(self, constraint: Constraint) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of constraint, from the cache or a new compile in the worker."""
        future = self._cache.get(constraint)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(constraint)
            self.stats["grammar_cache_hits"] += 1
            return future
        self.stats["grammar_compiles"] += 1
        future = self._pool.submit(self._compile, constraint)
        self._cache[constraint] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)

    def compiler(self) -> xgr.GrammarCompiler:
        """The xgrammar compiler over this model's tokenizer, built on first use (in the worker)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        compiler = self.compiler()
        try:
            if c.kind == "json":
                # any_whitespace=False: compact JSON. With free whitespace a small model under greedy
                # decoding can emit newlines forever, never closing the object (vLLM offers the same switch).
                return compiler.compile_json_schema(c.value, any_whitespace=False, strict_mode=True)
            if c.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if c.kind == "regex":
                return compiler.compile_regex(c.value)
            if c.kind == "choice":  # a grammar of string literals; json.dumps escapes as EBNF reads them
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in c.choices))
            if c.kind == "grammar":
                return compiler.compile_grammar(c.value)
            return compiler.compile_structural_tag(c.value)
        except Exception as e:  # noqa: BLE001 - the compiler's own exception types vary; the message is the point
            message = _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise GrammarError(f"invalid {_WHAT[c.kind]}: {message}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
         "grammar": "grammar", "structural_tag": "structural tag"}


# -------------------------------------------------------------------- the step's side

# byte -> the penalties of its 8 tokens, least significant bit first (xgrammar's bit order): [256, 8]
_PENALTY = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                    np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def advance(seq: Sequence, token: int) -> bool:
    """seq's matcher takes the token it just appended. -> True when the grammar has ended (the sequence
    stops). Raises when the token breaks the grammar: a bug, which fails this request only."""
    m = seq.matcher
    assert m is not None
    if not m.accept_token(token):
        raise RuntimeError(f"token {token} is not allowed by the request's grammar")
    return bool(m.is_terminated())


def apply_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: logits[i, t] = -inf for every token t the grammar of seqs[i] does not allow next. Rows
    without a matcher are untouched. Idempotent, so sampling the same rows again (the runner's one-by-one
    retry) gives the same result. logits: [B, V] float32 on the CPU or a device."""
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
    penalty = torch.from_numpy(_PENALTY[rows_bytes].reshape(len(rows), -1)[:, :vocab])  # [R, V] float32
    penalty = penalty.to(logits.device, logits.dtype)
    if len(rows) == logits.shape[0]:
        logits.add_(penalty)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), penalty)
