"""EngineCore: the engine without sockets. add / abort / step; tests and the offline API drive it
in-process, engine/loop.py drives it from ZeroMQ."""
from __future__ import annotations

import functools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine import pooling, prompt_logprobs
from engine.admission import Limits
from engine.block_manager import BlockManager, release_window
from engine.kv_cache import KVCache
from engine.load.weights import load_model
from engine.observe.trace import Tracer, no_mark
from engine.request import Request
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import LogprobEntry, Sequence
from engine.speculative import can_speculate, make_proposer
from engine.step import Delta, EngineFault, StepPlan
from engine.structured import Grammars
from kernels import get_backend, one_attention_kernel
from kernels.backend import backend_limit
from shared.config import EngineConfig
from shared.embedding import PoolingParams
from shared.errors import InvalidRequest
from shared.model_source import resolve_model
from shared.protocol import Error, RequestOutput
from shared.sampling import SamplingParams
from shared.tokenizer import load_tokenizer

log = logging.getLogger("conveyor.engine")


@dataclass(frozen=True)
class StepRecord:
    """What one step computed: (request_id, num_new_tokens) per scheduled sequence."""

    step: int
    scheduled: tuple[tuple[str, int], ...]
    preempted: tuple[str, ...]


class EngineCore:
    def __init__(self, config: EngineConfig, free_block_order: list[int] | None = None) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        device = torch.device(config.device)
        self.source = resolve_model(config.model)
        t0 = time.perf_counter()
        tp_runner = None
        if config.tensor_parallel_size > 1:  # the runner holds rank 0's shard and KV; workers hold the rest
            from engine.distributed.executor import start_tensor_parallel

            tp_runner, self.model_config = start_tensor_parallel(config, self.source, device)
            model, kv = tp_runner.model, tp_runner.kv_cache
        else:
            model, self.model_config = load_model(self.source, config.dtype, device, config.quantization,
                                                  deterministic=config.deterministic)
        mc = self.model_config
        dtype = getattr(torch, mc.dtype)  # --dtype auto resolved against the checkpoint and the CPU
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if tp_runner is None:
            kv = KVCache(config.cache, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, device)
        num_blocks, block_size = kv.num_blocks, kv.block_size
        backend = get_backend(config.attention_backend, device, dtype, config.deterministic)
        if config.deterministic and not one_attention_kernel(backend):
            raise ValueError("--deterministic needs one attention kernel for prompt and decode rows: the native "
                             "CPU kernel (--attention-backend cpu, and a C++ compiler at the first start)")
        self.max_model_len = min(self.max_model_len, backend_limit(mc, backend))
        if kv.device.dtype != dtype and not backend.casts_kv:
            raise ValueError(f"kv_cache_dtype {config.cache.kv_cache_dtype} differs from the model's {mc.dtype}: only "
                             "the cpu and torch attention backends cast between them (--attention-backend cpu)")
        self.proposer = make_proposer(config.speculative, mc, num_blocks, config.cache, dtype, device, backend)
        draft_len = self.proposer.max_model_len if self.proposer is not None else None
        if draft_len:  # a draft model's context
            self.max_model_len = min(self.max_model_len, draft_len)
        window = release_window(mc.layer_windows, backend.supports_window, draft_model=bool(draft_len))
        self.block_manager = BlockManager(num_blocks, block_size, free_block_order, kv.num_cpu_blocks,
                                          config.cache.enable_prefix_caching, window)
        # A request must always fit the pool alone, or preemption could never make room for it: its whole
        # context, or with released windows its window and one step's tokens.
        bm = self.block_manager
        live = bm.max_live_blocks(config.scheduler.max_num_batched_tokens)
        if live is None or live > bm.num_blocks:
            self.max_model_len = min(self.max_model_len, bm.num_blocks * block_size)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, self.proposer)
        if tp_runner is not None:  # drafts are proposed on rank 0 alone; verification is in the sharded forward
            tp_runner.proposer = self.proposer
        self.runner = tp_runner or ModelRunner(model, kv, backend, device, self.proposer)
        self.limits = Limits(mc.vocab_size, self.max_model_len, config.scheduler.max_num_seqs, bm.num_blocks,
                             block_size, live)
        self.eos_token_ids = tuple(mc.eos_token_ids)
        self.pooling = pooling.resolve(self.source.folder, mc.hidden_size, config.pooling,
                                       tensor_parallel=tp_runner is not None)
        self.runner.pool_mode = self.pooling.mode
        # Structured output: grammars compile in worker processes; the tokenizer loads on first use.
        self.grammars = Grammars(functools.partial(load_tokenizer, self.source), mc.vocab_size, self.eos_token_ids,
                                 timeout=config.grammar_compile_timeout)
        self.sequences: dict[str, Sequence] = {}  # each live request's first (root) sequence, by request id
        self.num_steps = 0
        self.step_seconds = 0.0  # wall-clock time spent in step(): mean step time = delta / delta num_steps
        self.totals = {"prefill_tokens": 0, "decode_tokens": 0,
                       "embedding_requests": 0, "embedding_tokens": 0}
        self.last_step: dict[str, float] = {}
        self.history: deque[StepRecord] = deque(maxlen=4096)
        self.tracer: Tracer | None = None  # engine/observe/trace.py, while a trace records
        self.mark = no_mark
        log.info("engine ready in %.1fs: %s, max_model_len %d, %d KV blocks of %d",
                 time.perf_counter() - t0, self.source.name, self.max_model_len, bm.num_blocks, block_size)

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
            pool: PoolingParams | None = None) -> None:
        """Raises InvalidRequest when the request can never run; nothing is queued then. FCFS is by
        the engine's own clock at receipt: clients' clocks differ (and skew across machines). pool: an
        embedding request (engine/pooling.py), whose params are not used."""
        if request_id in self.sequences:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if pool is None:
            self.limits.check(prompt_token_ids, params)
        else:
            pooling.check(self.pooling, self.limits, prompt_token_ids, pool)
            params = SamplingParams(max_tokens=1)
        speculate = pool is None and self.proposer is not None and can_speculate(params)
        req = Request(request_id, prompt_token_ids, params, priority, time.monotonic(), self.eos_token_ids,
                      speculate=speculate, pooling=pool)
        req.events["queued"] = time.time()
        root = Sequence(req)
        self.sequences[request_id] = root
        if params.constraint is not None and pool is None:
            self.grammars.add(root)  # the scheduler gets it once its grammar is compiled (step)
        else:
            self.scheduler.add(root)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Idempotent: unknown or finished ids are ignored. -> one final output per live request."""
        outs = []
        for rid in request_ids:
            root = self.sequences.pop(rid, None)
            if root is None:
                continue
            if not self.grammars.drop(rid):
                self.scheduler.abort(root)
            req = root.request
            outs.append(RequestOutput(rid, [], True, "abort", req.num_prompt_tokens, req.num_cached_tokens))
        return outs

    def stop_choice(self, request_id: str, index: int) -> list[RequestOutput | Error]:
        """End one choice of a request (a stop string the gateway found in its text), freeing its blocks.
        -> its "stop" row, which ends the request when it was the last choice running; nothing when
        the request or choice is unknown, finished, or not streamed (the client has not seen it)."""
        root = self.sequences.get(request_id)
        g = root.group if root is not None else None
        if g is None or not g.streams:
            return []
        seq = next((s for s in g.seqs if s.index == index), None)
        return [self._output(d) for d in self.scheduler.stop_sequence(seq)] if seq is not None else []

    def fail_all(self, why: str) -> list[Error]:
        """End every request in the engine with an error (the step failed in a way no one request
        explains), freeing every block. -> one ERROR per request."""
        errors = [_failed(rid, why) for rid in self.sequences]
        self.abort(list(self.sequences))
        return errors

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammars.waiting)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput | Error]:
        """One step. -> each request's new tokens, or an ERROR for a request that failed in it."""
        t0 = time.perf_counter()
        compiled = self._take_compiled()  # requests whose grammar is ready join the scheduler
        self.mark("schedule")
        plan = self.scheduler.schedule()  # who runs, how many tokens, which blocks
        if not plan:
            return compiled
        if self.tracer is not None:
            self.tracer.before_execute(plan)
        try:
            output = self.runner.execute(plan)  # swap, copy, one forward, one sample
        except EngineFault:  # no request's fault, and no later step can run: the caller ends the engine
            raise
        except Exception as e:  # the shared forward: only this step's requests can have caused it
            log.exception("step %d failed; ending the %d requests it computed", self.num_steps + 1, len(plan.seqs))
            deltas = self.scheduler.fail(plan, f"{type(e).__name__}: {e}")
        else:
            self.mark("output")
            deltas = self.scheduler.update(plan, output)  # advance, stop, free
        outputs = [self._output(d) for d in deltas]
        self._record(plan, time.perf_counter() - t0)
        if self.tracer is not None:
            self.tracer.end_step(self.num_steps, plan, outputs, self.sequences)
        return compiled + outputs

    def _take_compiled(self) -> list[RequestOutput | Error]:
        """Schedule the requests whose grammar compiled; an ERROR (400, the compiler's message) for those
        whose constraint does not compile. With nothing else to run, wait a moment for a compile rather
        than spin the loop (a new message waits at most that long)."""
        if not self.grammars.waiting:  # the common step: no constrained request waits for its grammar
            return []
        if not self.scheduler.has_work():
            self.grammars.wait(0.005)
        ready, failed = self.grammars.ready()
        for root in ready:
            self.scheduler.add(root)
        for rid, _, _ in failed:
            del self.sequences[rid]
        return [Error(rid, why, status) for rid, why, status in failed]

    def set_tracer(self, tracer: Tracer | None) -> None:
        """Record steps and request lifecycles into tracer from the next step on (None: stop recording)."""
        self.tracer = tracer
        self.mark = self.runner.mark = tracer.mark if tracer is not None else no_mark

    def _output(self, d: Delta) -> RequestOutput | Error:
        req = d.request
        if d.finished:
            del self.sequences[req.request_id]
        if d.error is not None:
            return _failed(req.request_id, d.error)
        embedding = None
        if d.pooled is not None and req.pooling is not None:
            embedding = pooling.finish(d.pooled, req.num_prompt_tokens, self.pooling, req.pooling)
            self.totals["embedding_requests"] += 1
            self.totals["embedding_tokens"] += req.num_prompt_tokens
        return RequestOutput(req.request_id, d.new_token_ids, d.finished, d.finish_reason, req.num_prompt_tokens,
                             req.num_cached_tokens, req.events if d.finished else None,
                             _wire_logprobs(d.logprobs), d.index, prompt_logprobs.to_wire(d.prompt_logprobs),
                             embedding)

    def close(self) -> None:
        """Stops what the engine started besides itself (tensor-parallel workers)."""
        self.runner.close()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks, or after swapping weights); running requests go on."""
        self.block_manager.reset_prefix_cache()

    def _record(self, plan: StepPlan, seconds: float) -> None:
        self.num_steps += 1
        self.step_seconds += seconds
        self.totals["prefill_tokens"] += plan.num_tokens - plan.num_decode_tokens
        self.totals["decode_tokens"] += plan.num_decode_tokens
        self.last_step = {"step_prefill_tokens": plan.num_tokens - plan.num_decode_tokens,
                          "step_decode_tokens": plan.num_decode_tokens, "step_num_seqs": len(plan.seqs),
                          "step_seconds": seconds, "step_preempted": len(plan.preempted),
                          "step_swapped_out_blocks": len(plan.swap_out), "step_swapped_in_blocks": len(plan.swap_in)}
        self.history.append(StepRecord(
            self.num_steps,
            tuple((s.request.request_id, n) for s, n in zip(plan.seqs, plan.num_new_tokens)),
            tuple(s.request.request_id for s in plan.preempted),
        ))

    def stats(self) -> dict[str, float]:
        """Gauges and counters for STATS and /metrics: a flat name -> number map."""
        s, bm = self.scheduler, self.block_manager
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_swapped": len(s.swapped),
            # Tokens the waiting requests still have to prefill: the load a data-parallel router balances.
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
            **{f"total_{k}_tokens" if k.startswith("prefix") else f"total_{k}": v for k, v in bm.stats.items()},
            "num_cached_device_blocks": len(bm.device.cached),
            "num_cached_cpu_blocks": len(bm.cpu.cached),
            **{f"total_{k}": v for k, v in self.totals.items()},
            **self.last_step,
            **self._spec_stats(),
            "num_waiting_grammar": len(self.grammars.waiting),
            **{f"total_{k}": v for k, v in self.grammars.stats.items()},
        }

    def _spec_stats(self) -> dict[str, float]:
        """Speculative decoding: counters, the share of drafts accepted, and tokens per verification
        (accepted drafts + the one the target adds: 1.0 means speculation bought nothing)."""
        if self.proposer is None:
            return {}
        st = self.scheduler.spec_stats
        drafts, accepted, steps = st["spec_draft_tokens"], st["spec_accepted_tokens"], st["spec_verifications"]
        return {**{f"total_{k}": v for k, v in st.items()},
                "spec_acceptance_rate": accepted / drafts if drafts else 0.0,
                "spec_mean_accepted_length": 1 + accepted / steps if steps else 0.0}


def _wire_logprobs(entries: list[LogprobEntry] | None) -> list[list] | None:
    """[(logprob, [(id, logprob), ...]), ...] -> JSON-ready [[logprob, [[id, logprob], ...]], ...]."""
    if entries is None:
        return None
    return [[lp, [[t, v] for t, v in top]] for lp, top in entries]


def _failed(request_id: str, why: str) -> Error:
    """A request the engine itself failed (not the client's input): an internal error, 500."""
    return Error(request_id, f"the engine failed this request: {why}", 500)
