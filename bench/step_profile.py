"""Where a decode step's time goes, next to what the arithmetic allows.

Issue #15 asks for this split before any performance lever is pulled, so that each lever
is kept only when it moves its own line. The offline EngineCore (no sockets, no gateway)
holds a decode-heavy batch (default 32 sequences over contexts of 64..700 tokens) and runs
decode steps twice:
1. timed without a profiler: step, model forward, sampling, and the rest (scheduling, input
   building, output processing: Python outside the model);
2. under torch.profiler: the forward split by the op that Python called (its time with its
   children): GEMMs (linear/addmm/mm, torch's int4/int8 and the AMX int4 kernel), attention (SDPA or
   the native kernel), K/V gathers and writes (index_select & co. inside the attention backend),
   attention's other ops (layouts, copies), elementwise (RMSNorm, RoPE, SiLU-and-mul, residual adds,
   casts), the embedding, and dispatch/Python between ops. Where the decoder layers run in one
   native call (the default on AMX CPUs and in float32: engine/models/llama.py NativeStack), that
   call is one row, its ops and the C++ between them inside it, and the dispatch row is the Python
   around it;
   --python-layers runs each layer's Python forward instead, split as above.
Then the arithmetic ceiling of one step: its model FLOPs (the linear layers and LM head for the rows
computed, plus attention over each context) at the GEMM speed measured here in the same dtype.

    python bench/step_profile.py [--configs auto:auto,bfloat16:none | --dtype D --quantization Q]
                                 [--num-seqs 1,32] [--context 64,700] [--prompt-chunk N]
                                 [--steps 10] [--attention-backend auto|cpu|torch]
                                 [--native-max-context auto|none|N] [--ops] [--python-layers]

--configs: dtype:quantization pairs, profiled one after the other in this run; the default,
auto:auto, is what `conveyor serve` runs (--dtype auto --quantization auto). A summary of every
(configuration, batch) pair closes the run, side by side.
--prompt-chunk N: a mixed step instead, the decodes plus one new N-token prompt whole in every
measured step (a request of one output token added before each step), as served steps carry prompt
chunks.

--ops: the elementwise row split by op (calls and ms a step), to see which of the layer's small ops
a change moved.
--sampling: only the noise a step of random rows (temperature > 0) draws, for --num-seqs rows:
torch's exponential_ row by row against engine.sampler.exponential_ (the same values), seeded
or not.

A bench, not an engine flag: it wraps the runner's model, sampler and attention
backend from outside.
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time
from collections import defaultdict
from typing import Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import cpu_features, gemm_gflops, machine, min_ms, pin_threads
from bench.scheduler_policies import Timed
from shared.config import QUANTIZATIONS

# Labels of the ranges this bench opens around the runner's parts.
MODEL, SAMPLING = "bench::model", "bench::sampling"
ATTENTION, PLAN = "bench::attention", "bench::attention_plan"
GEMM_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm", "aten::baddbmm",
            # prepacked weights (engine/load/prepack.py)
            "mkldnn::_linear_pointwise",
            # quantized (engine/load/quant.py)
            "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
            # AMX int4 (engine/load/amx.py)
            "conveyor_cpu::int4_gemm_amx", "conveyor_cpu::int4_gemm_rows",
            "conveyor_cpu::int8_gemm_amx", "conveyor_cpu::int8_gemm_rows",
            # int4 on AVX-512 BF16 without AMX (engine/load/int4_avx512.py)
            "conveyor_cpu::int4_gemm_avx512",
            # int4 and int8 with float32 activations on AVX2 (engine/load/int4_avx2.py, int8_avx2),
            # and int4 with 8-bit activations (w4a8)
            "conveyor_cpu::int4_gemm_avx2", "conveyor_cpu::int8_gemm_avx2",
            "conveyor_cpu::int4_gemm_avx2_q8"}
SDPA_PREFIX = ("aten::scaled_dot_product", "aten::_scaled_dot_product", "aten::_flash_attention",
               # the native kernel (kernels/cpu), alone or after its K/V write in one call
               "conveyor_cpu::paged_attention", "conveyor_cpu::write_and_attend")
GATHER_OPS = {"aten::index_select", "aten::index", "aten::gather", "aten::take"}
WRITE_OPS = {"aten::index_put_", "aten::index_copy_", "aten::index_put", "aten::scatter_",
             "aten::_index_put_impl_"}
ROWS = ["GEMMs (linear, addmm, mm, int4/int8)", "attention (SDPA or native kernel)",
        "K/V gathers (index_select)", "K/V writes", "attention: other ops",
        "elementwise (norms, RoPE, SiLU, adds, casts)", "embedding",
        "decoder layers in one native call (all of the above inside)",
        "dispatch and Python between ops"]
# every decoder layer in one call (kernels/cpu/decoder_layers.cpp): its GEMMs, attention and small
# ops run in C++, where the profiler does not see them one by one
NATIVE_LAYERS = "conveyor_cpu::decoder_layers"


class Ranged:
    """Calls the wrapped callable inside a profiler range, so its ops can be told apart."""

    def __init__(self, fn: Any, label: str) -> None:
        self.fn, self.label = fn, label

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.profiler import record_function

        with record_function(self.label):
            return self.fn(*args, **kwargs)


class WrappedBackend:
    """The attention backend with its per-layer forward and its per-step plan replaced
    by wrappers."""

    def __init__(self, backend: Any, forward: Any, plan: Any) -> None:
        self.backend, self.forward, self.plan = backend, forward, plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def fill(core: Any, num_seqs: int, context: tuple[int, int], steps: int) -> None:
    """Admits num_seqs sequences with prompts spread over the context range and steps until all
    decode. Their output limit outlasts the fill (prompts may be admitted one a step, and the
    first ones decode meanwhile) and every measured pass, so each measured step holds all
    num_seqs sequences."""
    from shared.sampling import SamplingParams

    rng = random.Random(0)
    lo, hi = context
    max_tokens = num_seqs + 3 * steps + 16
    for i in range(num_seqs):
        n = lo + (hi - lo) * i // max(1, num_seqs - 1)
        core.add(f"p{i}", [rng.randrange(100, 40000) for _ in range(n)],
                 SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while any(live.root.num_output_tokens == 0 for live in core.requests.values()):
        core.step()
    for _ in range(3):  # shape-dependent warm-up in oneDNN and the allocator
        core.step()


def prompts_for(core: Any, steps: int, prompt_chunk: int) -> list[list[int]]:
    """One prompt of prompt_chunk random tokens per step (none without prompt_chunk), drawn
    before timing."""
    rng = random.Random(core.num_steps)
    return [[rng.randrange(100, 40000) for _ in range(prompt_chunk)]
            for _ in range(steps if prompt_chunk else 0)]


def run_steps(core: Any, steps: int, prompts: list[list[int]]) -> None:
    """steps steps; with prompts, each after admitting the next one (one output token). Admitting is
    the engine's work (a served loop does it between steps), so it is timed with the step."""
    from shared.sampling import SamplingParams

    for i in range(steps):
        if prompts:
            core.add(f"chunk{core.num_steps}", prompts[i],
                     SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        core.step()


def timed_steps(core: Any, steps: int, prompt_chunk: int = 0) -> dict[str, float]:
    """ms per step: the whole step, the model forward, sampling, the rest, and the attention plan
    (part of the rest: the runner builds it before the forward)."""
    runner = core.runner
    saved = runner.model, runner.sampler, runner.backend
    model, sampler, plan = Timed(runner.model), Timed(runner.sampler), Timed(runner.backend.plan)
    runner.model, runner.sampler = model, sampler
    runner.backend = WrappedBackend(saved[2], saved[2].forward, plan)
    prompts = prompts_for(core, steps, prompt_chunk)
    t0 = time.perf_counter()
    try:
        run_steps(core, steps, prompts)
    finally:
        runner.model, runner.sampler, runner.backend = saved
    total = (time.perf_counter() - t0) / steps * 1e3
    fwd, smp = model.total / steps * 1e3, sampler.total / steps * 1e3
    return {"step": total, "forward": fwd, "sampling": smp, "outside": total - fwd - smp,
            "plan": plan.total / steps * 1e3}


def profiled_steps(core: Any, steps: int, prompt_chunk: int = 0,
                   ops: dict[str, list[float]] | None = None) -> dict[str, float]:
    """ms per step of each row of ROWS (inside the forward), from the ops Python called directly;
    ops, when given, gets the elementwise row's ops: name -> [calls, ms] per step."""
    from torch.profiler import ProfilerActivity, profile

    runner = core.runner
    saved = runner.model, runner.sampler, runner.backend
    backend = WrappedBackend(saved[2], Ranged(saved[2].forward, ATTENTION),
                             Ranged(saved[2].plan, PLAN))
    runner.model, runner.sampler = Ranged(runner.model, MODEL), Ranged(runner.sampler, SAMPLING)
    runner.backend = backend
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_steps(core, steps, prompts_for(core, steps, prompt_chunk))
    finally:
        runner.model, runner.sampler, runner.backend = saved
    split: dict[str, float] = defaultdict(float)
    forward = 0.0
    for ev in prof.events():
        if ev.name == MODEL:
            forward += ev.cpu_time_total
            continue
        chain = _ancestors(ev)
        if not chain or chain[-1] != MODEL or ev.name == ATTENTION:  # a range: accounted by its ops
            continue
        parent = ev.cpu_parent.name if ev.cpu_parent is not None else ""
        if parent not in (MODEL, ATTENTION):
            continue  # not called from Python directly: its time is in its caller's
        row = _row(ev.name, parent)
        split[row] += ev.cpu_time_total
        if ops is not None and row == ROWS[5]:
            calls_ms = ops.setdefault(ev.name, [0.0, 0.0])
            calls_ms[0] += 1 / steps
            calls_ms[1] += ev.cpu_time_total / steps / 1e3
    split[ROWS[-1]] = forward - sum(split.values())
    return {k: v / steps / 1e3 for k, v in split.items()}  # us total -> ms per step


def _ancestors(ev: Any) -> list[str]:
    names = []
    while ev.cpu_parent is not None:
        ev = ev.cpu_parent
        names.append(ev.name)
    return names


def _row(name: str, parent: str) -> str:
    if parent == ATTENTION:
        if name.startswith(SDPA_PREFIX):
            return ROWS[1]
        if name in GATHER_OPS:
            return ROWS[2]
        if name in WRITE_OPS:
            return ROWS[3]
        return ROWS[4]
    if name == NATIVE_LAYERS:
        return ROWS[7]
    if name in GEMM_OPS:
        return ROWS[0]
    if name == "aten::embedding":
        return ROWS[6]
    return ROWS[5]


def step_flops(contexts: list[int], layers: int = 30, hidden: int = 576, inter: int = 1536,
               kv: int = 192, vocab: int = 49152, prompt: int = 0) -> float:
    """One decode step: each sequence's one token through every linear layer and the LM head, and
    attention (QK^T and PV) over its whole context; plus a prompt of that many tokens (one LM head
    row, causal attention)."""
    linear = 2 * layers * (hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter)
    per_token = linear + 2 * hidden * vocab
    prompt_flops = ((prompt * linear + 2 * hidden * vocab + 2 * layers * hidden * prompt * prompt)
                    if prompt else 0)
    return sum(per_token + 4 * layers * hidden * ctx for ctx in contexts) + prompt_flops


def print_split(timed: dict[str, float], prof: dict[str, float], scale: float) -> None:
    """The step's table: each profiled row of the forward (scaled to the unprofiled forward), then
    the timed parts around it."""
    print("| part of the step | ms | share of the step |")
    print("|---|---:|---:|")
    for row in ROWS:
        ms = prof.get(row, 0.0) * scale
        print(f"| forward: {row} | {ms:.2f} | {ms / timed['step']:.1%} |")
    print(f"| **model forward** | **{timed['forward']:.2f}** | "
          f"**{timed['forward'] / timed['step']:.1%}** |")
    print(f"| sampling | {timed['sampling']:.2f} | {timed['sampling'] / timed['step']:.1%} |")
    print(f"| Python outside the model (schedule, inputs, outputs) | {timed['outside']:.2f} | "
          f"{timed['outside'] / timed['step']:.1%} |")
    print(f"| of which: attention planning (masks, block tables) | {timed['plan']:.2f} | "
          f"{timed['plan'] / timed['step']:.1%} |")
    print(f"| **step** | **{timed['step']:.2f}** | 100% |")


def print_ops(ops: dict[str, list[float]], scale: float) -> None:
    """The elementwise row by op, largest first (scaled as the rows), so a fused op shows in
    its own line."""
    print("\n| elementwise op | calls a step | ms a step |\n|---|---:|---:|")
    for name, (calls, ms) in sorted(ops.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {calls:.0f} | {ms * scale:.2f} |")


def profile_config(args: argparse.Namespace, dtype: str, quantization: str,
                   num_seqs: int) -> dict[str, Any]:
    """Profiles one configuration at one batch. -> its summary figures (the closing table's row)."""
    import torch

    import engine.load.weights
    from engine.core import EngineCore
    from shared.config import build_config

    if args.no_prepack:  # the lever's baseline: projections stay nn.Linear (engine/load/prepack.py)
        # for the rest of this process: loading finds prepacking unusable
        mock.patch.object(engine.load.weights, "usable", lambda *_: False).start()
    room = num_seqs + (args.prompt_chunk > 0)  # the mixed step's prompt is one sequence more
    longest = args.context[1] + num_seqs + 3 * args.steps + 16
    core = EngineCore(build_config(args.model, dtype=dtype, num_threads=args.threads,
                                   max_num_seqs=room, max_num_batched_tokens=2048,
                                   kv_cache_memory="2GiB", max_model_len=max(1024, longest),
                                   attention_backend=args.attention_backend,
                                   quantization=quantization, kv_cache_dtype=args.kv_cache_dtype,
                                   speculative="none"))  # steps of one token a sequence
    # what auto resolved to
    dtype, quantization = core.model_config.dtype, core.model_config.quantization
    if args.python_layers:
        core.runner.model.native_stack = None  # type: ignore[assignment]
    backend = core.runner.backend
    if args.native_max_context != "auto" and hasattr(backend, "native_max_context"):
        native_max = args.native_max_context
        backend.native_max_context = None if native_max == "none" else int(native_max)
    limit = (getattr(backend, "native_max_context", None) if getattr(backend, "native", False)
             else "off")
    print(f"\n## {dtype}, quantization {quantization}: {num_seqs} sequences decoding over contexts "
          f"{args.context[0]}..{args.context[1]}, {args.steps} steps each pass; native kernel's "
          f"context limit: {limit}" + (f"; plus a {args.prompt_chunk}-token prompt in every step"
                                       if args.prompt_chunk else ""), flush=True)
    fill(core, num_seqs, args.context, args.steps)
    contexts = [live.root.num_tokens for live in core.requests.values()]
    timed = timed_steps(core, args.steps, args.prompt_chunk)
    ops: dict[str, list[float]] = {}
    prof = profiled_steps(core, args.steps, args.prompt_chunk, ops)
    # the profiled pass moved the contexts: time once more, take the mean
    again = timed_steps(core, args.steps, args.prompt_chunk)
    timed = {k: (timed[k] + again[k]) / 2 for k in timed}
    # a sequence ended mid-measure: the figures are for a smaller batch
    if len(core.requests) != num_seqs:
        raise RuntimeError(f"{num_seqs - len(core.requests)} sequences finished while measured")
    flops = step_flops(contexts, prompt=args.prompt_chunk)
    peak = gemm_gflops(dtype=dtype)
    at_rows = gemm_gflops(n_tokens=num_seqs, dtype=dtype)
    torch.set_num_threads(args.threads)
    ceiling = flops / (peak * 1e9) * 1e3
    prof_total = sum(prof.values())
    print(f"step {timed['step']:.1f} ms = {num_seqs / timed['step'] * 1e3:.0f} output tok/s "
          f"(mean context {sum(contexts) / len(contexts):.0f})\n")
    # the profiler's own cost, spread evenly over the forward's rows
    scale = timed["forward"] / prof_total
    print_split(timed, prof, scale)
    print(f"\narithmetic ceiling: {flops / 1e9:.2f} GFLOP a step at the measured {peak:.0f} "
          f"GFLOP/s {dtype} GEMM (256x576x1536) = {ceiling:.2f} ms ({timed['step'] / ceiling:.1f}x "
          f"below the step); the same GEMM at {num_seqs} rows runs at {at_rows:.0f} GFLOP/s = "
          f"{flops / (at_rows * 1e9) * 1e3:.2f} ms")
    gemm_ms = prof.get(ROWS[0], 0.0) * scale
    linear_flops = flops - sum(4 * 30 * 576 * c
                               for c in contexts) - 2 * 30 * 576 * args.prompt_chunk**2
    if gemm_ms > 0:  # none outside the native call where every GEMM runs inside it
        print(f"GEMMs in the forward: {linear_flops / 1e9:.2f} GFLOP in {gemm_ms:.2f} ms = "
              f"{linear_flops / (gemm_ms / 1e3) / 1e9:.0f} GFLOP/s")
    print(f"(profiled forward {prof_total:.1f} ms against {timed['forward']:.1f} ms unprofiled; "
          f"rows scaled by {scale:.2f})", flush=True)
    if args.ops:
        print_ops(ops, scale)
    core.abort(list(core.requests))
    return {"config": f"{dtype}, {quantization}", "seqs": num_seqs, "step": timed["step"],
            "gemm": gemm_ms, "forward": timed["forward"]}


def sampling_noise(args: argparse.Namespace) -> None:
    """The exponential race's noise for a step of random rows (temperature > 0), seeded and not,
    over the model's vocabulary: torch's exponential_ row by row (the sampler before session 28)
    against engine.sampler.exponential_, which draws the same values; ms a step, best of --steps."""
    import torch

    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(resolve_model(args.model)))
    print(f"exponential noise for random rows over a {vocab}-token vocabulary, ms per step "
          f"(best of {args.steps}); x: torch / ours")
    print("| rows | seeded | torch exponential_ | engine.sampler.exponential_ | x |")
    print("|---:|---|---:|---:|---:|")
    for n in args.num_seqs:
        noise = torch.empty(n, vocab)
        for seeded in (False, True):
            gens = [torch.Generator().manual_seed(i) if seeded else None for i in range(n)]
            theirs, ours = (min_ms(functools.partial(_draw_noise, noise, gens, o), args.steps)
                            for o in (False, True))
            print(f"| {n} | {'yes' if seeded else 'no'} | {theirs:.2f} | {ours:.2f} | "
                  f"{theirs / ours:.2f} |")


def _draw_noise(noise: Any, gens: list[Any], ours: bool) -> None:
    """Each row of noise filled from its generator: by torch's exponential_, or by ours."""
    from engine.sampler import exponential_

    for i, g in enumerate(gens):
        if ours:
            exponential_(noise[i], g)
        else:
            noise[i].exponential_(generator=g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--configs", type=lambda v: [tuple(c.split(":")) for c in v.split(",")],
                    default=[("auto", "auto")],
                    help=f"dtype:quantization pairs (auto|float32|bfloat16 : "
                         f"{'|'.join(QUANTIZATIONS)}); default auto:auto, the server's default")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "both"],
                    help="shorthand for --configs DTYPE:QUANTIZATION (both: float32 and bfloat16)")
    ap.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                    help="with --dtype: the quantization (default auto, as the server)")
    ap.add_argument("--num-seqs", type=lambda v: [int(n) for n in v.split(",")], default=[32],
                    help="decoding sequences in a step: one number or a list (1,32)")
    ap.add_argument("--context", type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=(64, 700),
                    help="shortest,longest prompt; the sequences spread evenly between them")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt-chunk", type=int, default=0,
                    help="N > 0: a mixed step, every measured step also prefills a new N-token "
                         "prompt")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="auto | bfloat16 | ...: the KV cache's dtype (as the server's option)")
    ap.add_argument("--attention-backend", default="auto",
                    help="auto | cpu | torch (the native kernel's baseline)")
    ap.add_argument("--ops", action="store_true",
                    help="also list the elementwise row's ops, largest first")
    ap.add_argument("--python-layers", action="store_true",
                    help="each decoder layer's Python forward, never the layers in one native "
                         "call: the ops split by row")
    ap.add_argument("--sampling", action="store_true",
                    help="only the sampler's noise for --num-seqs random rows: torch's "
                         "exponential_ against engine.sampler.exponential_")
    ap.add_argument("--no-prepack", action="store_true",
                    help="projections as plain nn.Linear (the baseline)")
    ap.add_argument("--native-max-context", default="auto",
                    help="auto | none | N: the most context tokens a step's decodes may attend for "
                         "the native kernel to take them (kernels/torch_backend.py; auto: this "
                         "CPU's setting)")
    args = ap.parse_args()
    pin_threads(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"machine: {machine()}; {cpu_features()}")
    print(f"command: python bench/step_profile.py {' '.join(sys.argv[1:])}")
    if args.sampling:
        return sampling_noise(args)
    if args.dtype is not None:
        dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
        args.configs = [(d, args.quantization) for d in dtypes]
    rows = [profile_config(args, dtype, quant, n) for n in args.num_seqs
            for dtype, quant in args.configs]
    print("\n## Summary (this run, side by side)\n")
    print("| configuration (dtype, quantization) | sequences | step ms | output tok/s | GEMMs ms | "
          "step vs first |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        first = next(f for f in rows if f["seqs"] == r["seqs"])
        print(f"| {r['config']} | {r['seqs']} | {r['step']:.2f} | "
              f"{r['seqs'] / r['step'] * 1e3:.0f} | {r['gemm']:.2f} | "
              f"{r['step'] / first['step']:.2f} |")


if __name__ == "__main__":
    main()
