"""EngineCore: the engine without sockets. add / abort / step; tests and the offline API drive it
in-process, engine/loop.py drives it from ZeroMQ."""
from __future__ import annotations

import functools
import logging
import time

from engine import pooling, prompt_logprobs
from engine.build import build
from engine.observe.trace import Tracer, no_mark
from engine.request import Request
from engine.requests import LiveRequest, RequestTable, RoutedOutputs
from engine.scheduler import Scheduler
from engine.sequence import LogprobEntry, Sequence
from engine.speculative import can_speculate
from engine.step import Delta, EngineFault, StepPlan
from engine.structured import Grammars
from shared.config import EngineConfig
from shared.embedding import PoolingParams
from shared.errors import InvalidRequest
from shared.protocol import Error, RequestOutput
from shared.sampling import SamplingParams
from shared.tokenizer import load_tokenizer

log = logging.getLogger("conveyor.engine")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        parts = build(config)  # engine/build.py: model, cache, backend, proposer, blocks, limits
        self.source, self.model_config, self.runner = parts.source, parts.model_config, parts.runner
        self.proposer, self.block_manager = parts.proposer, parts.block_manager
        self.pooling = parts.pooling
        self.max_model_len, self.limits = parts.max_model_len, parts.limits
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   self.proposer)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        # Structured output: grammars compile in worker processes; the tokenizer loads on first use.
        self.grammars = Grammars(functools.partial(load_tokenizer, self.source),
                                 self.model_config.vocab_size, self.eos_token_ids,
                                 timeout=config.grammar_compile_timeout)
        # every live request: its root sequence, client, pending grammar
        self.requests = RequestTable()
        self.num_steps = 0
        # wall-clock time spent in step(): mean step time = delta / delta num_steps
        self.step_seconds = 0.0
        self.totals = {"prefill_tokens": 0, "decode_tokens": 0,
                       "embedding_requests": 0, "embedding_tokens": 0}
        self.last_step: dict[str, float] = {}
        self.tracer: Tracer | None = None  # engine/observe/trace.py, while a trace records
        self.mark = no_mark
        bm = self.block_manager
        log.info("engine ready in %.1fs: %s, max_model_len %d, %d KV blocks of %d",
                 time.perf_counter() - t0, self.source.name, self.max_model_len, bm.num_blocks,
                 bm.block_size)

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0, pool: PoolingParams | None = None,
            client: bytes | None = None) -> None:
        """Raises InvalidRequest when the request can never run; nothing is queued then. FCFS is by
        the engine's own clock at receipt: clients' clocks differ (and skew across machines). pool:
        an embedding request (engine/pooling.py), whose params are not used. client: who owns it
        (the loop routes its outputs there)."""
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if pool is None:
            self.limits.check(prompt_token_ids, params)
        else:
            pooling.check(self.pooling, self.limits, prompt_token_ids, pool)
            params = SamplingParams(max_tokens=1)
        speculate = (pool is None and self.proposer is not None
                     and can_speculate(params, self.proposer.greedy_only))
        req = Request(request_id, prompt_token_ids, params, priority, time.monotonic(),
                      self.eos_token_ids, speculate=speculate, pooling=pool)
        req.events["queued"] = time.time()
        root = Sequence(req)
        constraint = params.constraint if pool is None else None
        grammar = self.grammars.compile(constraint) if constraint is not None else None
        self.requests.add(request_id, LiveRequest(root, client, grammar))
        # a constrained one joins the scheduler once its grammar compiled (step)
        if grammar is None:
            self.scheduler.add(root)

    def abort(self, request_ids: list[str]) -> RoutedOutputs:
        """Idempotent: unknown or finished ids are ignored. -> one final output per live request."""
        outs = RoutedOutputs()
        for rid in request_ids:
            record = self._end(rid)
            if record is not None:
                req = record.root.request
                outs.add(RequestOutput(rid, [], True, "abort", req.num_prompt_tokens,
                                       req.num_cached_tokens), record.client)
        return outs

    def _end(self, request_id: str) -> LiveRequest | None:
        """A request ends before it finished (abort, client gone, failure): out of the
        table, and out of whatever holds it: its compile (killed when no one else waits for
        it) or the scheduler's queues (every sequence of it, blocks freed). -> its record;
        None when it was not live."""
        record = self.requests.end(request_id)
        if record is None:
            return None
        if record.grammar is not None:
            if all(f is not record.grammar for f in self.requests.compiling().values()):
                self.grammars.release(record.grammar)
        else:
            self.scheduler.abort(record.root)
        return record

    def stop_choice(self, request_id: str, index: int) -> RoutedOutputs:
        """End one choice of a request (a stop string the gateway found in its text), freeing
        its blocks. -> its "stop" row, which ends the request when it was the last choice
        running; nothing when the request or choice is unknown, finished, or not streamed (the
        client has not seen it)."""
        record = self.requests.get(request_id)
        g = record.root.group if record is not None else None
        outs = RoutedOutputs()
        seq = next((s for s in g.seqs if s.index == index),
                   None) if g is not None and g.streams else None
        for d in self.scheduler.stop_sequence(seq) if seq is not None else []:
            self._emit(outs, d)
        return outs

    def fail_all(self, why: str) -> RoutedOutputs:
        """End every request in the engine with an error (the step failed in a way no one request
        explains), freeing every block. -> one ERROR per request."""
        outs = RoutedOutputs()
        for rid in list(self.requests):
            record = self._end(rid)
            assert record is not None
            outs.add(_failed(rid, why), record.client)
        return outs

    def close(self) -> None:
        """Ends every request still live (the engine stops), then what the engine started besides
        itself: tensor-parallel workers, the grammar compile server."""
        try:
            for rid in list(self.requests):
                self._end(rid)
        finally:
            self.runner.close()
            self.grammars.close()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.requests.num_compiling > 0

    # ------------------------------------------------------------------ the step
    def step(self) -> RoutedOutputs:
        """One step. -> each request's new tokens, or an ERROR for a request that failed in it."""
        t0 = time.perf_counter()
        compiled = self._take_compiled()  # requests whose grammar is ready join the scheduler
        self.mark("schedule")
        plan = self.scheduler.schedule()  # who runs, how many tokens, which blocks
        if not plan:
            return compiled
        if self.tracer is not None:
            self.tracer.before_execute(plan)
        outputs = compiled  # then swap, copy, one forward, one sample; advance, stop, free
        for d in self._run(plan):
            self._emit(outputs, d)
        self._record(plan, time.perf_counter() - t0)
        if self.tracer is not None:
            self.tracer.end_step(self.num_steps, plan, outputs, self.requests)
        return outputs

    def _run(self, plan: StepPlan) -> list[Delta]:
        """The plan executed and applied. A forward that fails ends only this step's
        requests; an EngineFault (no request's fault, and no later step can run) goes up: the
        caller ends the engine."""
        try:
            output = self.runner.execute(plan)
        except EngineFault:
            raise
        except Exception as e:  # the shared forward: only this step's requests can have caused it
            log.exception("step %d failed; ending the %d requests it computed", self.num_steps + 1,
                          len(plan.seqs))
            return self.scheduler.fail(plan, f"{type(e).__name__}: {e}")
        self.mark("output")
        return self.scheduler.update(plan, output)

    def _take_compiled(self) -> RoutedOutputs:
        """Schedule the requests whose grammar compiled; an ERROR (400, the compiler's message) for
        those whose constraint does not compile. With nothing else to run, wait a moment for a
        compile rather than spin the loop (a new message waits at most that long)."""
        outs = RoutedOutputs()
        # the common step: no constrained request waits for its grammar
        if not self.requests.num_compiling:
            return outs
        if not self.scheduler.has_work():
            self.grammars.wait(self.requests.compiling().values(), 0.005)
        ready, failed = self.grammars.ready(self.requests.compiling())
        for rid, matcher in ready:
            self.requests.compiled(rid)
            self.scheduler.add(self.requests[rid].root, matcher)
        for rid, why, status in failed:
            record = self.requests.end(rid)  # its compile is over: nothing else holds it
            assert record is not None
            outs.add(Error(rid, why, status), record.client)
        return outs

    def set_tracer(self, tracer: Tracer | None) -> None:
        """Record steps and request lifecycles into tracer from the next step on
        (None: stop recording)."""
        self.tracer = tracer
        self.mark = self.runner.mark = tracer.mark if tracer is not None else no_mark

    def _emit(self, outs: RoutedOutputs, d: Delta) -> None:
        """d's output into outs, with its client; a delta that ends its request ends it in the table
        (the scheduler has ended its sequences and freed their blocks)."""
        rid = d.request.request_id
        record = self.requests.end(rid) if d.finished else self.requests.get(rid)
        assert record is not None, f"an output for {rid}, which is not live"
        outs.add(self._output(d), record.client)

    def _output(self, d: Delta) -> RequestOutput | Error:
        req = d.request
        if d.error is not None:
            return _failed(req.request_id, d.error)
        embedding = None
        if d.pooled is not None and req.pooling is not None:
            embedding = pooling.finish(d.pooled, req.num_prompt_tokens, self.pooling, req.pooling)
            self.totals["embedding_requests"] += 1
            self.totals["embedding_tokens"] += req.num_prompt_tokens
        return RequestOutput(req.request_id, d.new_token_ids, d.finished, d.finish_reason,
                             req.num_prompt_tokens, req.num_cached_tokens,
                             req.events if d.finished else None, _wire_logprobs(d.logprobs),
                             d.index, prompt_logprobs.to_wire(d.prompt_logprobs), embedding)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks, or after swapping weights); running requests go
        on."""
        self.block_manager.reset_prefix_cache()

    def _record(self, plan: StepPlan, seconds: float) -> None:
        self.num_steps += 1
        self.step_seconds += seconds
        self.totals["prefill_tokens"] += plan.num_tokens - plan.num_decode_tokens
        self.totals["decode_tokens"] += plan.num_decode_tokens
        self.last_step = {"step_prefill_tokens": plan.num_tokens - plan.num_decode_tokens,
                          "step_decode_tokens": plan.num_decode_tokens,
                          "step_num_seqs": len(plan.seqs), "step_seconds": seconds,
                          "step_preempted": len(plan.preempted),
                          "step_swapped_out_blocks": len(plan.swap_out),
                          "step_swapped_in_blocks": len(plan.swap_in)}

    def stats(self) -> dict[str, float]:
        """Gauges and counters for STATS and /metrics: a flat name -> number map."""
        s, bm = self.scheduler, self.block_manager
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_swapped": len(s.swapped),
            # Tokens the waiting requests still have to prefill: the load a data-parallel router
            # balances.
            "num_queued_tokens": sum(q.num_tokens - q.num_computed_tokens for q in s.waiting),
            "kv_usage": bm.usage,
            "cpu_kv_usage": bm.cpu.usage,
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "num_free_cpu_blocks": bm.cpu.num_free,
            "num_cpu_blocks": bm.cpu.num_blocks,
            "num_preemptions_swap": s.num_preemptions["swap"],
            "num_preemptions_recompute": s.num_preemptions["recompute"],
            "total_stalled_steps": s.num_stalled_steps,
            "num_steps": self.num_steps,
            "total_step_seconds": self.step_seconds,
            **{f"total_{k}_tokens" if k.startswith("prefix") else f"total_{k}": v
               for k, v in bm.stats.items()},
            "num_cached_device_blocks": len(bm.device.cached),
            "num_cached_cpu_blocks": len(bm.cpu.cached),
            **{f"total_{k}": v for k, v in self.totals.items()},
            **self.last_step,
            **(self.scheduler.spec_stats.gauges() if self.proposer is not None else {}),
            "num_waiting_grammar": self.requests.num_compiling,
            **{f"total_{k}": v for k, v in self.grammars.stats.items()},
        }


def _wire_logprobs(
    entries: list[LogprobEntry] | None,
) -> list[list[float | list[list[float]]]] | None:
    """[(logprob, [(id, logprob), ...]), ...] -> JSON-ready [[logprob, [[id, logprob], ...]],
    ...]."""
    if entries is None:
        return None
    return [[lp, [[t, v] for t, v in top]] for lp, top in entries]


def _failed(request_id: str, why: str) -> Error:
    """A request the engine itself failed (not the client's input): an internal error, 500."""
    return Error(request_id, f"the engine failed this request: {why}", 500)
