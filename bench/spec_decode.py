"""Speculative decoding against plain decoding, in one run, on input-grounded prompts (edit, fix or
summarise a given text or code: the output copies long runs of the input, which prompt lookup
finds).

For each of 1 stream (the requests one after another) and 8 streams (all at once, twice) it prints
output tokens/s without and with speculation, the ratio, the acceptance rate and the mean accepted
length, and checks that the greedy outputs are identical. Plain and speculative runs alternate
request by request, so load from other jobs on a shared machine hits both sides alike. Target:
>= 1.8x single-stream with n-gram.

    python bench/spec_decode.py [--model SmolLM2-135M-Instruct] [--speculative ngram] [-k 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine, pin_threads, token_outputs

if TYPE_CHECKING:
    from engine.core import EngineCore

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def oldest_user(users):
    best = None
    for user in users:
        if best is None or user["age"] > best["age"]:
            best = user
    return best
'''

TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Several "
        "shop owners said the lanes had reduced parking and hurt their business, while cyclists "
        "said the lanes had made the street much safer. The council agreed to collect traffic data "
        "for three more months before deciding whether to keep the lanes, move them, or remove "
        "them.")

TASKS = [
    "Rename the function load_users to read_users everywhere in this code. Reply with the full "
    f"code only.\n\n{CODE}",
    f"Add a docstring to each function in this code. Reply with the full code only.\n\n{CODE}",
    "Rewrite this code to use the variable name person instead of user. Reply with the full code "
    f"only.\n\n{CODE}",
    f"Copy this text and replace 'Main Street' with 'Oak Avenue':\n\n{TEXT}",
    f"Summarise this text in two sentences, reusing its own words:\n\n{TEXT}",
    "Fix the indentation of this code and reply with the full code "
    f"only.\n\n{CODE.replace('    ', '  ')}",
    f"Repeat the following text exactly, then say DONE:\n\n{TEXT}",
    "Convert this code's comments and names to snake_case where they are not. Reply with the "
    f"code.\n\n{CODE}",
]


def run(core: EngineCore, prompts: list[list[int]],
        max_tokens: int) -> tuple[float, int, list[list[int]]]:
    """All prompts at once. -> (seconds, output tokens, outputs)."""
    from shared.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        # ids are reused across runs: the engine forgets finished requests
        core.add(f"s{i}", prompt, params)
    while core.has_work():
        for o in token_outputs(core.step()):
            outs[o.request_id] += o.new_token_ids
    return time.perf_counter() - t0, sum(map(len, outs.values())), [outs[f"s{i}"]
                                                                    for i in range(len(prompts))]


def compare(plain: EngineCore, spec: EngineCore, groups: list[list[list[int]]],
            max_tokens: int) -> tuple[float, float, float, bool]:
    """Each group of prompts runs plain, then speculative, alternating, so both see the same machine
    (other load on a shared machine hits both sides alike).
    -> (plain tok/s, spec tok/s, plain steps / spec steps, identical)."""
    totals = {"plain": [0.0, 0], "spec": [0.0, 0]}
    steps = {"plain": 0, "spec": 0}
    identical = True
    for group in groups:
        outs = {}
        for name, core in (("plain", plain), ("spec", spec)):
            before = core.num_steps
            seconds, tokens, outs[name] = run(core, group, max_tokens)
            totals[name][0] += seconds
            totals[name][1] += tokens
            steps[name] += core.num_steps - before
        identical &= outs["plain"] == outs["spec"]
    return (totals["plain"][1] / totals["plain"][0], totals["spec"][1] / totals["spec"][0],
            steps["plain"] / steps["spec"], identical)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--speculative", default="ngram", help="ngram or draft:<model>")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    pin_threads(args.threads)

    from engine.core import EngineCore
    from shared.config import build_config
    from shared.tokenizer import apply_chat_template, load_tokenizer

    common = dict(kv_cache_memory="512MiB", max_num_batched_tokens=2048,
                  enable_prefix_caching=False)
    plain = EngineCore(build_config(args.model, speculative="none", **common))
    spec = EngineCore(build_config(args.model, speculative=args.speculative,
                                   num_speculative_tokens=args.num_speculative_tokens,
                                   ngram_min=args.ngram_min, **common))
    tok = load_tokenizer(plain.source)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": t}]) for t in TASKS]
    print(f"machine: {machine()}")
    print(f"model: {args.model}; {len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens; greedy, up to "
          f"{args.max_tokens} output tokens; speculative={args.speculative}, "
          f"k={args.num_speculative_tokens}, ngram_min={args.ngram_min}")
    for core in (plain, spec):  # warm up allocators and thread pools
        run(core, prompts[:1], 8)

    # "fewer steps": plain steps / speculative steps, the gain a step of equal cost would give
    # (exact, whatever the machine's load); the tok/s ratio is what it gives here, verification
    # steps included.
    print(f"{'streams':>8} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'fewer steps':>12} "
          f"{'accept':>7} {'mean len':>9} identical")
    for streams, groups in ((1, [[p] for p in prompts]), (8, [prompts, prompts])):
        before = dict(spec.scheduler.spec_stats)
        base_tps, spec_tps, step_ratio, identical = compare(plain, spec, groups, args.max_tokens)
        st = {k: v - before[k] for k, v in spec.scheduler.spec_stats.items()}
        accept = st["spec_accepted_tokens"] / max(st["spec_draft_tokens"], 1)
        mean_len = 1 + st["spec_accepted_tokens"] / max(st["spec_verifications"], 1)
        print(f"{streams:>8} {base_tps:>12.1f} {spec_tps:>11.1f} {spec_tps / base_tps:>5.2f}x "
              f"{step_ratio:>11.2f}x "
              f"{accept:>7.1%} "
              f"{mean_len:>9.2f} {'yes' if identical else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
