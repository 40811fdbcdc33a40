"""Quantized weights: memory, decode speed and accuracy of SmolLM2 served as float32, bfloat16, int8
and int4 weights, all in this run, each in its own process (so resident memory is its own).

For each configuration: the weights' bytes and the process's resident memory once the engine is up
(over the bare interpreter with torch imported, less the KV cache it preallocates); decode tokens/s
at 1 stream (a 32-token prompt, 64 new tokens) and at 32 streams (32 such prompts, 32 new tokens
each), wall time of the whole generate call, prefill included; and the accuracy cost against the
float32 model on a fixed set of 8 prompts: greedy agreement (share of the 24 generated positions
equal to float32's, position by position) and the mean log-probability difference of float32's own
greedy continuation (teacher-forced through each model); and, teacher-forced over --text's first
1,024 tokens, the perplexity, the mean KL divergence from float32's next-token distributions and
the share of positions where the most likely token is float32's.

Loading is measured apart, in a process that only loads the model: its peak resident memory
(ru_maxrss) and its resident memory once loaded, both over the interpreter with the engine imported.

    python bench/quantized.py [--threads 2] [--model SmolLM2-135M-Instruct] [--streams 1]
    python bench/quantized.py --gemm [--threads 2] [--activations float32]
    python bench/quantized.py --head [--threads 2] [--rows 1,2,32,64] [--head-fp32]
    python bench/quantized.py --ab [--threads 2] [--reps 7] [--cpu-time]
    python bench/quantized.py --fbgemm [--threads 2] [--rows 32,512]

--gemm measures what engine/load/prepack.py's QUANTIZED_PACKED_FROM_ROWS holds per CPU kind: the
model's quantized projections (int4) and its tied LM head (int8), each called in turn as a forward
calls them, through torch's int kernels, through the packed bfloat16 copies and, on AMX CPUs,
through the AMX kernel's tiles ("AMX") and its rows path ("AMX rows", up to 8 rows: the same bits),
by row count; each set of passes is taken when the machine is quiet (other processes under --quiet
of the CPUs), the best of --reps.

--gemm --activations float32: the int4 projections under float32 activations, through the AVX2
int4 kernel (kernels/cpu/quant_gemm_avx2.cpp), the same with x rounded to 8 bits ("w4a8",
kernels/cpu/quant_gemm_avx2_q8.cpp: what --quantization auto serves on CPUs without native
bfloat16) and packed float32 copies (MKL's plain matrix from prepack.PLAIN_FROM_ROWS, as the float32
model), with each one's GFLOP/s.

int8 / int4 take bfloat16 activations (what --dtype auto picks for a quantized file on a CPU with
native bfloat16, and where PyTorch's int kernels are fast); --with-fp32-activations adds them under
float32 activations, the kernels' slow path.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import cpu_features, machine, pin_threads

if TYPE_CHECKING:
    import torch
    from torch import nn

    from engine.models.config import ModelConfig

PROMPTS = ["The capital of France is", "Name three colors.", "def fibonacci(n):",
           "Once upon a time", "Water boils at", "The quick brown fox",
           "Photosynthesis is the process", "1, 2, 3, 4,"]
ACCURACY_TOKENS = 24
TEXT_TOKENS, TEXT_WINDOW = 1024, 512  # the perplexity / KL text: tokens, and tokens a forward


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def next_token_logprobs(model: nn.Module, cfg: ModelConfig, seq: list[int],
                        first: int) -> torch.Tensor:
    """log p(. | seq[:i + 1]) for i = first .. len(seq) - 2 under model, one forward of seq over
    the paged cache. -> [len(seq) - 1 - first, vocab] float32."""
    import torch

    from kernels.backend import BatchLayout
    from kernels.torch_backend import TorchBackend

    n, bs = len(seq), 16
    blocks = (n + bs - 1) // bs
    backend = TorchBackend("cpu")
    kv = torch.zeros(cfg.num_layers, 2, blocks, bs, cfg.num_kv_heads, cfg.head_dim,
                     dtype=getattr(torch, cfg.dtype))
    layout = BatchLayout([n], [0], [list(range(blocks))], bs, torch.arange(n))
    with torch.inference_mode():
        logits = model(torch.tensor(seq), torch.arange(n), kv, backend.plan(layout), backend,
                       torch.arange(first, n - 1))
    return torch.log_softmax(logits.float(), dim=-1)


def teacher_forced_logprobs(model: nn.Module, cfg: ModelConfig, ids: list[int],
                            continuation: list[int]) -> list[float]:
    """log p(continuation[i] | ids + continuation[:i]) under model."""
    import torch

    lp = next_token_logprobs(model, cfg, ids + continuation, len(ids) - 1)
    return lp[torch.arange(len(continuation)), torch.tensor(continuation)].tolist()


def text_divergence(model: nn.Module, cfg: ModelConfig, ids: list[int],
                    reference: str | None) -> dict[str, float]:
    """Teacher-forced over ids in windows of TEXT_WINDOW tokens: the perplexity and, against the
    float32 model's next-token distributions (saved at reference by the float32 child, which has
    none to compare with), the mean KL divergence KL(float32 || this) and the share of positions
    whose most likely token is float32's (llama.cpp's perplexity --kl-divergence figures)."""
    import torch

    windows = [ids[i:i + TEXT_WINDOW] for i in range(0, len(ids) - 1, TEXT_WINDOW)]
    windows = [w for w in windows if len(w) > 1]
    lp = torch.cat([next_token_logprobs(model, cfg, w, 0) for w in windows])
    targets = torch.tensor([t for w in windows for t in w[1:]])
    out = {"ppl": math.exp(-lp[torch.arange(len(targets)), targets].mean().item())}
    if reference is None:
        return out
    path = Path(reference)
    if not path.exists():
        torch.save(lp, path)
        return out
    ref = torch.load(path)
    out["kl"] = (ref.exp() * (ref - lp)).sum(-1).mean().item()
    out["top1"] = (ref.argmax(-1) == lp.argmax(-1)).float().mean().item()
    return out


def load_only(args: argparse.Namespace) -> dict[str, int]:
    """Runs in a child process: load the model, nothing else. -> peak and final resident memory
    of the load."""
    import resource

    import torch

    from engine.load.weights import load_model
    from shared.model_source import resolve_model

    torch.set_num_threads(args.threads)
    base = rss_bytes()
    model, cfg = load_model(resolve_model(args.model), args.dtype, "cpu", args.quantization)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"load_peak": peak - base, "load_rss": rss_bytes() - base}


def one(args: argparse.Namespace) -> dict[str, Any]:
    """Runs in a child process: one configuration, every figure."""
    import torch

    from engine.load.quantize import weight_bytes
    from engine.offline import LLM
    from shared.model_source import resolve_model
    from shared.sampling import SamplingParams
    from shared.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    # the int kernels at every row count, as before the packed copies (engine/kernel_choice.py)
    if args.int_only:
        import engine.load.weights

        # for the rest of this child process: loading finds no copies to attach
        mock.patch.object(engine.load.weights, "attach_packed_copies", lambda *_: {}).start()
    base = rss_bytes()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
              num_threads=args.threads, kv_cache_memory="1GiB", num_cpu_blocks=0, max_num_seqs=32,
              speculative="none")  # decode steps of one token a sequence: the GEMMs' rows
    model, cfg = llm.core.runner.model, llm.core.model_config
    kv = llm.core.runner.kv_cache
    kv_bytes = sum(t.numel() * t.element_size() for t in (kv.device, kv.cpu))
    result: dict[str, Any] = {"weights": weight_bytes(model), "rss": rss_bytes() - base - kv_bytes,
              "quantization": cfg.quantization}
    tok = load_tokenizer(resolve_model(args.model))
    prompts = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=ACCURACY_TOKENS, ignore_eos=True)
    result["greedy"] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # float32's greedy continuations (this model's own for float32), teacher-forced
    # through this model
    ref = json.loads(args.reference) if args.reference else result["greedy"]
    result["logprobs"] = [teacher_forced_logprobs(model, cfg, p, c) for p, c in zip(prompts, ref)]
    text = tok.encode(Path(args.text).read_text())[:TEXT_TOKENS]
    result.update(text_divergence(model, cfg, text, args.kl_reference))
    filler = [tok.encode(f"Write a long story about the number {i} and the sea. ")
              for i in range(32)]
    filler = [(ids * 8)[:32] for ids in filler]
    # warm
    llm.generate(filler[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    for streams, new in ((1, 64), (32, 32)):
        if streams not in args.streams:
            continue
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        clock = time.process_time if args.cpu_time else time.perf_counter
        t0 = clock()
        llm.generate(filler[:streams], params, use_tqdm=False)
        result[f"tok_s_{streams}"] = streams * new / (clock() - t0)
    return result


def child(args: argparse.Namespace, dtype: str, quantization: str,
          reference: list[list[int]] | None, int_only: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--threads", str(args.threads), "--model", args.model,
           "--dtype", dtype, "--quantization", quantization, "--streams",
           ",".join(map(str, args.streams))]
    cmd += ["--cpu-time"] * args.cpu_time + ["--int-only"] * int_only
    if reference is not None:
        cmd += ["--reference", json.dumps(reference)]
    cmd += ["--text", args.text, "--kl-reference", args.kl_reference]
    result = {}
    for mode in ("--load-only", "--one"):
        out = subprocess.run([*cmd, mode], check=True, capture_output=True, text=True).stdout
        result.update(json.loads(out.strip().splitlines()[-1]))
    return result


def busy_share(seconds: float = 0.2) -> float:
    """The share of the machine's CPU time used over seconds (by anyone: call it while idle)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(n) for n in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(limit: float = 0.1, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if busy_share() < limit:
            return True
    return False


def gemm(args: argparse.Namespace) -> None:
    """The int kernels against the packed copies, by rows (see the module doc)."""
    import torch

    from engine import kernel_calibration, kernel_choice
    from engine.load.dtype import cpu_kind
    from engine.load.prepack import PackedLinear, plain_from_rows
    from engine.load.quant import Int4Linear
    from engine.load.weights import load_model
    from shared.model_source import resolve_model

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.activations)
    model, cfg = load_model(resolve_model(args.model), dtype, "cpu", "int4", prepack=False)
    modules = kernel_choice.switched_modules(model)
    # a copy for every matrix (no table, no calibration), so both sides can be timed
    for m in modules:
        m.packed = PackedLinear(m.dequantized(), None, plain_from_rows(dtype))
    print(f"{args.model}, {cfg.quantization} projections + int8 tied head, {args.activations} "
          f"activations, {args.threads} threads, CPU kind {cpu_kind()}; ms per pass (best of "
          f"{args.reps}{', CPU time' if args.cpu_time else ', wall clock'}), 'x' = int / packed"
          f"{'; int4: the AVX2 kernel' if dtype == torch.float32 else ''}")
    for kind in (("int4",) if dtype == torch.float32 else ("int4", "int8")):
        group = [m for m in modules if kernel_choice.kind_of(m) == kind]
        flop = 2 * sum(m.shape()[0] * m.shape()[1] for m in group)  # per row
        best: dict[int, list[float]] = {}
        w4a8 = dtype == torch.float32  # the AVX2 kernel with x rounded to 8 bits, too
        for _ in range(args.reps):
            for r in args.rows:
                quiet = args.quiet >= 1 or wait_quiet(args.quiet)
                clock = time.thread_time if args.cpu_time else time.perf_counter
                _, q, p, t, s = kernel_calibration.chain_times(group, [r], 1, clock)[0]
                q8 = float("inf")
                if w4a8:
                    int4 = [m for m in group if isinstance(m, Int4Linear)]
                    for m in int4:
                        m.avx2_q8 = True
                    q8 = kernel_calibration.chain_times(group, [r], 1, clock)[0][1]
                    for m in int4:
                        m.avx2_q8 = False
                if quiet:
                    old = best.setdefault(r, [q, p, t, s, q8])
                    best[r] = [min(a, b) for a, b in zip(old, (q, p, t, s, q8))]
        for r, (q, p, t, s, q8) in sorted(best.items()):
            amx = f"  AMX {t * 1e3:8.2f}" if t < float("inf") else ""
            amx += (f"  AMX rows {s * 1e3:8.2f}" if s < float("inf")
                    else "  AMX rows        -" if amx else "")
            rounded = (f"  w4a8 {q8 * 1e3:8.2f} (x {q8 / p:5.2f}, {flop * r / q8 / 1e9:5.1f} "
                       "GFLOP/s)" if w4a8 else "")
            print(f"{kind} x{len(group)} rows {r:>3}: int {q * 1e3:8.2f}  packed "
                  f"{p * 1e3:8.2f}{amx}  x {q / p:5.2f}  GFLOP/s int {flop * r / q / 1e9:5.1f} "
                  f"packed {flop * r / p / 1e9:5.1f}{rounded}")
        faster = [r for r, (q, p, *_) in best.items() if p < q]
        print(f"{kind}: packed faster at rows {sorted(faster)}", flush=True)
        tiles = [r for r, (q, p, t, *_) in best.items() if t < min(q, p)]
        if tiles:
            print(f"{kind}: AMX tiles fastest at rows {sorted(tiles)}", flush=True)
        by_rows = [r for r, (q, p, t, s, _) in best.items() if s < min(q, p, t)]
        if by_rows:
            print(f"{kind}: AMX rows path fastest at rows {sorted(by_rows)}", flush=True)
        beats = [r for r, (_, _, t, s, _) in best.items() if s < t]
        if beats:
            print(f"{kind}: AMX rows path faster than its tiles at rows {sorted(beats)}",
                  flush=True)


def head(args: argparse.Namespace) -> None:
    """The tied int8 head, one arithmetic at every row count or not (issue #30): for torch's int8
    kernel, the packed copy (the default from a few rows) and the packed copy padded at one row and
    cut into calls of prepack.ONEDNN_SAME_BITS_ROWS (--deterministic on AMX CPUs), the rows
    whose bits differ from the same row alone, then ms per call by rows (best of --reps)."""
    import torch

    from engine import kernel_choice
    from engine.load.prepack import ONEDNN_SAME_BITS_ROWS, PackedLinear
    from engine.load.weights import load_model
    from shared.model_source import resolve_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(resolve_model(args.model), "bfloat16", "cpu", "int4", prepack=False)
    m = next(m for m in kernel_choice.switched_modules(model) if kernel_choice.kind_of(m) == "int8")
    packed = PackedLinear(m.dequantized(), None)
    m.packed = PackedLinear(m.dequantized(), None, pad_one_row=True, max_rows=ONEDNN_SAME_BITS_ROWS)
    m.packed_from = 1
    kernels = {"int8 kernel": m.quantized_mm, "packed": packed.forward,
               "packed, padded and cut": m.forward}
    x = torch.randn(max(args.rows), m.shape()[1],
                    generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    print(f"{args.model}'s tied int8 head {m.shape()}, bfloat16 activations, "
          f"{args.threads} threads")
    for name, f in kernels.items():
        alone = torch.cat([f(x[i:i + 1]) for i in range(x.shape[0])])
        differ = {r: int((f(x[:r]) != alone[:r]).any(dim=1).sum()) for r in args.rows}
        print(f"{name}: rows differing from the row alone, by call rows: {differ}", flush=True)
    for r in args.rows:
        times = []
        for f in kernels.values():
            best = float("inf")
            for _ in range(args.reps):
                t0 = time.perf_counter()
                f(x[:r])
                best = min(best, time.perf_counter() - t0)
            times.append(f"{best * 1e3:7.2f}")
        print(f"rows {r:>3}: " + "  ".join(f"{n} {t}" for n, t in zip(kernels, times)), flush=True)


def head_fp32(args: argparse.Namespace) -> None:
    """--head with float32 activations (--dtype auto on CPUs without native bfloat16): the int8
    AVX2 kernel (engine/load/int8_avx2.py) against a float32 packed copy of q * scale (oneDNN;
    MKL from plain_from_rows, as prepack serves float32) and torch's _weight_int8pack_mm (its
    scalar path), the rows whose bits differ from the same row alone, then ms per call by rows:
    the best of --reps, the kernels alternating within each rep (torch's at most 3 reps)."""
    import torch

    from engine import kernel_choice
    from engine.load.prepack import PackedLinear, plain_from_rows
    from engine.load.quant import Int8Linear
    from engine.load.weights import load_model
    from shared.model_source import resolve_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(resolve_model(args.model), "float32", "cpu", "int4", prepack=False)
    m = next(m for m in kernel_choice.switched_modules(model) if kernel_choice.kind_of(m) == "int8")
    copy = PackedLinear(m.dequantized(), None, plain_from_rows(torch.float32))
    kernels = {"int8 AVX2": m.forward, "packed f32": copy.forward, "torch int8": m.quantized_mm}
    if isinstance(m, Int8Linear) and m.make_avx2():
        m.amx_from = 1
    else:
        del kernels["int8 AVX2"]
    x = torch.randn(max(args.rows), m.shape()[1], generator=torch.Generator().manual_seed(0))
    print(f"{args.model}'s tied int8 head {m.shape()}, float32 activations, {args.threads} "
          f"threads; packed f32 takes MKL from {copy.plain_from} rows")
    for name, f in kernels.items():
        alone = torch.cat([f(x[i:i + 1]) for i in range(min(x.shape[0], 32))])
        differ = {r: int((f(x[:r]) != alone[:r]).any(dim=1).sum()) for r in args.rows if r <= 32}
        print(f"{name}: rows differing from the row alone, by call rows: {differ}", flush=True)
    for r in args.rows:
        best = {name: float("inf") for name in kernels}
        for rep in range(args.reps):
            for name, f in kernels.items():
                if name == "torch int8" and rep >= 3:
                    continue
                t0 = time.perf_counter()
                f(x[:r])
                best[name] = min(best[name], time.perf_counter() - t0)
        ms = "  ".join(f"{n} {t * 1e3:8.2f}" for n, t in best.items())
        ratio = (f"  packed / AVX2 {best['packed f32'] / best['int8 AVX2']:5.2f}"
                 if "int8 AVX2" in best else "")
        print(f"rows {r:>3}: {ms}{ratio}", flush=True)


def fbgemm(args: argparse.Namespace) -> None:
    """FBGEMM's dynamic int8 linear (activations rounded to uint8 per call, int8 weights per output
    row) against MKL's float32 F.linear on SmolLM2's projection shapes with random weights, by
    rows: what int8 arithmetic could buy a float32 model on CPUs without bfloat16 or VNNI, and the
    relative error it costs (of the output's largest magnitude). Best of --reps."""
    import torch
    import torch.nn.functional as F
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"float32 F.linear (MKL) against FBGEMM dynamic int8, {args.threads} threads; GFLOP/s, "
          f"best of {args.reps}")
    for n, k, name in ((960, 576, "qkv"), (576, 576, "o"), (3072, 576, "gate_up"),
                       (576, 1536, "down")):
        w = torch.randn(n, k, generator=gen) * 0.05
        q = DynamicInt8Linear(k, n, bias_=False, dtype=torch.qint8)  # type: ignore[no-untyped-call]
        q.set_weight_bias(torch.quantize_per_channel(w, w.abs().amax(1) / 127,
                                                     torch.zeros(n, dtype=torch.long), 0,
                                                     torch.qint8), None)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            best = {}
            for label, f in (("float32", lambda a: F.linear(a, w)), ("int8", q)):  # noqa: B023
                f(x)
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    f(x)
                    times.append(time.perf_counter() - t0)
                best[label] = min(times)
            exact = F.linear(x, w)
            err = float((q(x) - exact).abs().max() / exact.abs().max())
            gflop = 2 * rows * n * k / 1e9
            print(f"{name} {n}x{k} rows {rows:>4}: float32 {gflop / best['float32']:6.1f}  int8 "
                  f"{gflop / best['int8']:6.1f}  int8 / float32 speed "
                  f"{best['float32'] / best['int8']:5.2f}x  relative error {err:.4f}", flush=True)


def ab(args: argparse.Namespace) -> None:
    """The default configuration against --dtype bfloat16 --quantization none in one process, runs
    alternating (ABBA), so that a shared machine's drift falls on both alike."""
    import torch

    from engine.offline import LLM
    from shared.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    llms = {name: LLM(args.model, dtype=dtype, quantization=quant, num_threads=args.threads,
                      kv_cache_memory="512MiB", num_cpu_blocks=0, max_num_seqs=32,
                      speculative="none")
            for name, dtype, quant in (("default", "auto", "auto"),
                                       ("bfloat16/none", "bfloat16", "none"))}
    clock = time.process_time if args.cpu_time else time.perf_counter
    prompts = [[100 + (i * 37 + j * 11) % 40000 for j in range(32)] for i in range(32)]
    for llm in llms.values():
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
    print(f"{args.model}, {args.threads} threads, tok/s by "
          f"{'CPU time' if args.cpu_time else 'wall clock'} of generate (32-token prompts, prefill "
          f"included), {args.reps} runs each alternating: median (best)")
    for streams, new in ((1, 64), (32, 24)):
        if streams not in args.streams:
            continue
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        got: dict[str, list[float]] = {name: [] for name in llms}
        for rep in range(args.reps):
            for name in list(llms) if rep % 2 == 0 else list(llms)[::-1]:
                t0 = clock()
                llms[name].generate([p[:] for p in prompts[:streams]], params, use_tqdm=False)
                got[name].append(streams * new / (clock() - t0))
        row = {name: (sorted(v)[len(v) // 2], max(v)) for name, v in got.items()}
        (d, db), (b, bb) = row["default"], row["bfloat16/none"]
        print(f"{streams:>2} streams: default ({llms['default'].core.model_config.quantization}) "
              f"{d:.1f} ({db:.1f}) tok/s, bfloat16/none {b:.1f} ({bb:.1f}), default / bfloat16 "
              f"{d / b:.3f}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--with-fp32-activations", action="store_true",
                   help="also int8 / int4 weights under float32 activations (PyTorch's slow path)")
    p.add_argument("--streams", type=lambda v: [int(n) for n in v.split(",")], default=[1, 32],
                   help="decode rows to measure: 1, 32 or 1,32 (default)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    p.add_argument("--kl-reference", help=argparse.SUPPRESS)  # the float32 child's distributions
    p.add_argument("--text", default=str(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"),
                   help="English text for the perplexity and KL figures (default: Python's own "
                        f"LICENSE.txt, its first {TEXT_TOKENS} tokens)")
    p.add_argument("--reference", help=argparse.SUPPRESS)
    p.add_argument("--gemm", action="store_true",
                   help="int kernels against packed copies by rows (see above)")
    p.add_argument("--activations", default="bfloat16", choices=["bfloat16", "float32"],
                   help="--gemm: float32 times the AVX2 int4 kernel against float32 copies")
    p.add_argument("--head", action="store_true",
                   help="the tied int8 head's kernels: row-invariant or not, ms")
    p.add_argument("--head-fp32", action="store_true",
                   help="--head with float32 activations (the default where bfloat16 is not "
                        "native): the int8 AVX2 kernel, a float32 packed copy, torch's int8")
    p.add_argument("--rows", type=lambda v: [int(n) for n in v.split(",")],
                   default=[1, 2, 4, 6, 8, 12, 16, 24, 32])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--configs", type=lambda v: v.split(","),
                   help="only these rows (float32, the accuracy reference, always runs): "
                        "bfloat16,int8,int4,int4-int-only,default")
    p.add_argument("--int-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fbgemm", action="store_true",
                   help="FBGEMM's dynamic int8 linear against float32 F.linear, by --rows")
    p.add_argument("--ab", action="store_true",
                   help="the default configuration against bfloat16/none, alternating in one "
                        "process")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by this process's CPU seconds, not the wall clock (a shared machine; "
                        "use --threads 1)")
    p.add_argument("--quiet", type=float, default=0.1,
                   help="--gemm: time only while other processes use less than this share of the "
                        "CPUs (1: always)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    pin_threads(args.threads)
    if args.gemm or args.ab or args.head or args.fbgemm:
        print(machine())
        print(cpu_features())
        from engine.load.dtype import cpu_has_native_bf16

        if args.head and (args.head_fp32 or not cpu_has_native_bf16()):
            head_fp32(args)
            return
        (gemm if args.gemm else head if args.head else fbgemm if args.fbgemm else ab)(args)
        return
    if args.one or args.load_only:
        print(json.dumps(one(args) if args.one else load_only(args)))
        return
    print(machine())
    print(cpu_features())
    # default: what `conveyor serve` runs (--dtype auto --quantization auto); int4 int-only: torch's
    # int4 kernel at every row count (the default before packed copies, engine/kernel_choice.py).
    # int4-fp32 / w4a8: the AVX2 int4 kernels under float32 activations, as they are and rounded
    # to 8 bits (what --quantization auto serves on AVX2 CPUs without native bfloat16).
    configs = [("float32", "float32", "none"), ("bfloat16", "bfloat16", "none"),
               ("int8", "bfloat16", "int8"), ("int4", "bfloat16", "int4"),
               ("int4-int-only", "bfloat16", "int4"), ("default", "auto", "auto"),
               ("int4-fp32", "float32", "int4"), ("w4a8", "float32", "w4a8")]
    from engine.load import int4_avx2

    avx2 = int4_avx2.usable()
    configs = [c for c in configs if c[0] == "float32" or (args.configs is None and (
        avx2 or c[0] not in ("int4-fp32", "w4a8"))) or c[0] in (args.configs or ())]
    if args.with_fp32_activations:  # torch's int kernels' slow path: tens of minutes on 2 cores
        configs += [("int8-fp32", "float32", "int8")] + [("int4-fp32", "float32", "int4")] * (
            not avx2)
    results: dict[str, dict[str, Any]] = {}
    scratch = tempfile.TemporaryDirectory()
    args.kl_reference = str(Path(scratch.name) / "float32-logprobs.pt")
    for name, dtype, quant in configs:
        ref = results["float32"]["greedy"] if results else None
        results[name] = child(args, dtype, quant, ref, name.endswith("int-only"))
        figures = {k: v for k, v in results[name].items() if k not in ("greedy", "logprobs")}
        print(f"  measured {name}: {json.dumps(figures)}", file=sys.stderr)
    base = results["float32"]
    clock = "this process's CPU time" if args.cpu_time else "wall time"
    print(f"\n{args.model}, {args.threads} threads; decode tok/s = new tokens / {clock} of "
          f"generate (prefill of 32-token prompts included); accuracy on {len(PROMPTS)} prompts x "
          f"{ACCURACY_TOKENS} greedy tokens against float32; perplexity, KL(float32 || it) and "
          f"top-1 agreement teacher-forced over {args.text}'s first {TEXT_TOKENS} tokens")

    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:>8.1f} {r[key] / base[key]:>6.2f}" if key in r else f"{'-':>8} {'-':>6}"

    print(f"{'weights':<10} {'quant':>6} {'weight MiB':>10} {'load peak':>9} {'loaded':>7} "
          f"{'RSS MiB':>8} {'tok/s 1':>8} {'x fp32':>6} {'tok/s 32':>8} {'x fp32':>6} "
          f"{'greedy agree':>12} {'mean dlogprob':>13} {'ppl':>7} {'KL':>8} {'top-1':>6}")
    for name, r in results.items():
        agree = sum(a == b for x, y in zip(r["greedy"], base["greedy"]) for a, b in zip(x, y))
        total = sum(len(x) for x in base["greedy"])
        dlp = [a - b for x, y in zip(r["logprobs"], base["logprobs"]) for a, b in zip(x, y)]
        print(f"{name:<10} {r['quantization']:>6} {r['weights'] / 2**20:>10.0f} "
              f"{r['load_peak'] / 2**20:>9.0f} {r['load_rss'] / 2**20:>7.0f} "
              f"{r['rss'] / 2**20:>8.0f} {ratio(r, 'tok_s_1')} {ratio(r, 'tok_s_32')} "
              f"{agree / total:>12.1%} {sum(dlp) / len(dlp):>+13.4f} {r['ppl']:>7.3f} "
              f"{r.get('kl', 0.0):>8.5f} {r.get('top1', 1.0):>6.1%}")


if __name__ == "__main__":
    main()
