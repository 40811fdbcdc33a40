"""The whole engine on a CUDA GPU: the Triton attention backend against the PyTorch one, and the
Triton backend's decode steps eager against replayed as CUDA graphs, side by side.

One seeded workload (prompts 32..512 tokens, outputs 8..256, ignore_eos) through the offline engine
on each in this run, same model, dtype and limits. Prints output tok/s of each, their ratio,
and whether the greedy tokens agree (float32 must agree exactly; in bfloat16 the two backends round
differently, so the share of requests whose tokens agree is printed instead).

A GPU machine here cannot download weights, so the model is a checkpoint of the given shape with
random weights, written with transformers (the speed of a step does not depend on the weights):

    python bench/gpu_engine.py [--shape smollm2|llama-1b] [--dtype bfloat16] [--num-requests 256]

On a machine without a GPU it says so and exits with status 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import TypedDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import Workload, workload


class LlamaShape(TypedDict):
    """The LlamaConfig fields a shape sets (typed, so that mypy checks them against LlamaConfig)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool


SHAPES: dict[str, LlamaShape] = {
    "smollm2": LlamaShape(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": LlamaShape(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=8,
                     intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False),
}


def write_checkpoint(shape: str, folder: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2)
    model = LlamaForCausalLM(config)
    # transformers wraps PreTrainedModel.to with functools.wraps(nn.Module.to), whose type keeps
    # nn.Module.to's self as the first argument of the bound method
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# (name, attention backend, enforce_eager): the torch backend never replays graphs (its plan is
# built on the host each step); the Triton backend with and without them.
RUNS = [("torch", "torch", True), ("triton eager", "triton", True),
        ("triton graphs", "triton", False)]


def run(model: str, backend: str, eager: bool, reqs: Workload,
        args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    import torch

    from engine.offline import LLM
    from shared.sampling import SamplingParams

    llm = LLM(model, device="cuda", dtype=args.dtype, attention_backend=backend,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory="8GiB", enforce_eager=eager)
    # compile and warm up
    llm.generate([[100, 101, 102]], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == [n for _, n in reqs]
    return elapsed, [list(o.token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure")
        return
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {args.dtype}, "
          f"shape {args.shape}")
    reqs = workload(args.num_requests, (32, 512), (8, 256), vocab=SHAPES[args.shape]["vocab_size"])
    out_tokens = sum(n for _, n in reqs)
    print(f"workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{out_tokens} output tokens")
    with tempfile.TemporaryDirectory() as folder:
        model = write_checkpoint(args.shape, folder)
        results = {name: run(model, backend, eager, reqs, args) for name, backend, eager in RUNS}
    base = results["torch"][0]
    print(f"\n{'run':16s}{'seconds':>10s}{'output tok/s':>14s}{'vs torch':>10s}")
    for name, (secs, _) in results.items():
        print(f"{name:16s}{secs:10.2f}{out_tokens / secs:14.1f}{base / secs:9.2f}x")
    for a, b in (("torch", "triton eager"), ("triton eager", "triton graphs")):
        same = sum(x == y for x, y in zip(results[a][1], results[b][1]))
        print(f"greedy tokens of {a} and {b} equal on {same} of {len(reqs)} requests")


if __name__ == "__main__":
    main()
