"""Offline throughput: Conveyor's offline API against transformers `generate` with static batches.

One seeded workload (default 64 requests, prompts 32..512 tokens, outputs 8..256, ignore_eos) on
SmolLM2-135M-Instruct, both sides in this run, in the same dtype (--dtype, float32 by default)
with the same pinned threads. Output
tokens/s counts only the tokens each request asked for. Also prints the arithmetic ceiling: the
workload's model FLOPs at the measured GEMM speed of this machine.

    python bench/offline_throughput.py [--num-requests 64] [--batch-size 64] [--threads 2]
                                       [--dtype bfloat16] [--kv-cache-dtype bfloat16]
                                       [--skip-baseline]

--kv-cache-dtype adds a second Conveyor run in this one with K/V stored in that dtype (the model in
--dtype), its time set against the first. --seeded-sampling adds a run whose requests sample at
temperature 1, each with its own seed (every row draws a vocabulary's noise from its own generator
each step), its time set against the greedy run's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import Workload, gemm_gflops, machine, pin_threads, workload


def run_conveyor(reqs: Workload, args: argparse.Namespace, kv_cache_dtype: str = "auto",
                 seeded: bool = False) -> float:
    from engine.offline import LLM
    from shared.sampling import SamplingParams

    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=args.batch_size,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory="4GiB",
              dtype=args.dtype, kv_cache_dtype=kv_cache_dtype)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=1.0 if seeded else 0, seed=i if seeded else None,
                             max_tokens=n, ignore_eos=True)
              for i, (_, n) in enumerate(reqs)]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == [n for _, n in reqs]
    return elapsed


def run_transformers(reqs: Workload, args: argparse.Namespace) -> float:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from engine.load.weights import dequantized_folder
    from shared.model_source import resolve_model

    src = resolve_model(args.model)
    # A GGUF model loads from the HF folder Conveyor's loader derived from it (HF names, tied head):
    # from_pretrained(gguf_file=...) leaves SmolLM2's tied lm_head randomly initialised.
    folder = dequantized_folder(src) if src.gguf_file else src.folder
    # in eval mode already: from_pretrained calls model.eval()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(reqs), args.batch_size), desc="transformers", unit="batch"):
        batch = reqs[i : i + args.batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        # left padding, as generate expects for decoder-only models
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        n = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def model_flops(reqs: Workload, layers: int = 30, hidden: int = 576, inter: int = 1536,
                kv: int = 192, vocab: int = 49152) -> float:
    """Matmul FLOPs of the workload: every prompt and output token through every layer, the LM head
    once per generated token, and attention over each token's context."""
    per_token = 2 * layers * (hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter)
    total = 0.0
    for p, n in reqs:
        tokens = len(p) + n - 1
        total += tokens * per_token + n * 2 * hidden * vocab
        total += sum(4 * layers * hidden * ctx for ctx in range(1, tokens + 1))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64,
                    help="static batch size of the baseline = Conveyor's max_num_seqs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights, activations and KV cache of both sides (bfloat16 uses "
                         "AMX/AVX512-BF16 where the CPU has it)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="also run Conveyor with K/V stored in this dtype")
    ap.add_argument("--seeded-sampling", action="store_true",
                    help="also run Conveyor with every request sampled at temperature 1, seeded")
    ap.add_argument("--skip-baseline", action="store_true")
    args = ap.parse_args()
    pin_threads(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    reqs = workload(args.num_requests, (32, 512), (8, 256), vocab=49152)
    out_tokens = sum(n for _, n in reqs)
    print(f"machine: {machine()}")
    print(f"workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{out_tokens} output tokens")
    gflops = gemm_gflops(dtype=args.dtype)
    ceiling = model_flops(reqs) / (gflops * 1e9)
    conveyor = run_conveyor(reqs, args)
    kv_run = (None if args.kv_cache_dtype == "auto"
              else run_conveyor(reqs, args, args.kv_cache_dtype))
    seeded = run_conveyor(reqs, args, seeded=True) if args.seeded_sampling else None
    baseline = None if args.skip_baseline else run_transformers(reqs, args)
    print(f"\n{'':28s}{'seconds':>10s}{'output tok/s':>14s}{'vs baseline':>13s}")
    row = f"{baseline:10.1f}{out_tokens / baseline:14.1f}{1.0:12.2f}x" if baseline else "   skipped"
    print(f"{'transformers static batch':28s}" + row)
    ratio = f"{baseline / conveyor:12.2f}x" if baseline else ""
    print(f"{'conveyor':28s}{conveyor:10.1f}{out_tokens / conveyor:14.1f}{ratio}")
    if kv_run is not None:
        ratio = f"{baseline / kv_run:12.2f}x" if baseline else f"{'':13s}"
        print(f"{'conveyor, kv ' + args.kv_cache_dtype:28s}{kv_run:10.1f}"
              f"{out_tokens / kv_run:14.1f}{ratio}"
              f"   ({conveyor / kv_run:.2f}x the speed of conveyor)")
    if seeded is not None:
        ratio = f"{baseline / seeded:12.2f}x" if baseline else f"{'':13s}"
        print(f"{'conveyor, seeded sampling':28s}{seeded:10.1f}{out_tokens / seeded:14.1f}{ratio}"
              f"   ({conveyor / seeded:.2f}x the speed of greedy conveyor)")
    ratio = f"{baseline / ceiling:12.2f}x" if baseline else ""
    print(f"{'arithmetic ceiling':28s}{ceiling:10.1f}{out_tokens / ceiling:14.1f}{ratio}"
          f"   (model FLOPs at the measured {gflops:.0f} GFLOP/s {args.dtype} GEMM)")
    print(f"conveyor reaches {ceiling / conveyor:.0%} of the ceiling")


if __name__ == "__main__":
    main()
