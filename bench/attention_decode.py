"""bench/cpu_attention.py --decode: decode rows (bfloat16; float32 with --dtype float32) straight
through the native kernel's op, this tree's kernel against the one at a git revision (built beside
it under another op namespace), calls alternated one by one (each variant first in turn) in one
process, so drift on a shared machine hits every variant alike.

Three tables. "Hot": one batch's K/V re-read call after call (32 decodes over 408 tokens, the same
over a cache 20x larger, one decode over 200..2,000, 64 over 2,048): the host's large L3 keeps
much of it. "DRAM": what a served step does, each call reading the next of 30 layers' pools laid
out as the engine lays them (one [layers, 2, blocks, block, heads, dim] tensor, tables scattered
over twice the blocks needed), so K/V comes from memory as in a step (~300 MB a step); with a third
variant, this tree's kernel over the same pool allocated on 2 MB pages (engine.kv_cache.zeros_pool).
Between them, "prompt chunks": prompts of 256 and 512 tokens, a chunk of 128 over a cached 384 and
a served step's mix (31 decodes over 408 beside a 256-token prompt), K/V hot as in the first.
GB/s: the K/V bytes a call must read over its min time.
"""
from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

SHAPE = (9, 3, 64, 16)  # SmolLM2-135M: query heads, KV heads, head dim; the engine's block size
STEP_MIX = [64 + (636 * i) // 31 for i in range(32)]  # step_profile's 32 contexts over 64..700


def baseline_op(rev: str) -> Any:
    """The kernel's op at git revision rev, built from that revision's sources under the namespace
    conveyor_base (kernels/cpu/__init__.py's compiler command), loaded beside this tree's."""
    import hashlib
    import subprocess
    import tempfile
    from pathlib import Path

    import torch

    import kernels.cpu as native_cpu

    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp(prefix="attn-base-"))
    key = hashlib.sha256(torch.__version__.encode() + native_cpu._cpu_flags().encode())
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:kernels/cpu"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.split()
    for path in ["paged_attention.cpp", *(n for n in listed if n.endswith(".h"))]:
        text = subprocess.run(["git", "show", f"{rev}:kernels/cpu/{path}"], cwd=root,
                              capture_output=True, text=True, check=True).stdout
        (folder / path).write_text(text.replace("TORCH_LIBRARY(conveyor_cpu,",
                                                "TORCH_LIBRARY(conveyor_base,"))
        key.update(text.encode())
    # built once per source
    lib = native_cpu._cache_dir() / f"attention-base-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        cmd = [a for a in native_cpu._command(folder / "base.so") if not a.endswith(".cpp")]
        cmd.insert(cmd.index("-o"), str(folder / "paged_attention.cpp"))
        subprocess.run(cmd, check=True)
        (folder / "base.so").rename(lib)
    torch.ops.load_library(str(lib))
    return torch.ops.conveyor_base.paged_attention


def alternate(calls: dict[str, Callable[[int], None]], runs: int) -> dict[str, list[float]]:
    """ms per call of each variant (called with a count that picks its pool: a variant must not
    read what the one before it just did), one call each per round, the order reversed every other
    round; 3 rounds of warm-up."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(runs + 3):
        for k, call in sorted(calls.items(), reverse=i % 2 == 1):
            t0 = time.perf_counter()
            call(i * len(calls) + list(calls).index(k))  # no two calls in a row on one pool
            if i >= 3:
                times[k].append((time.perf_counter() - t0) * 1e3)
    return times


def batch(lens: list[int], blocks: int, gen: Any, dtype: Any,
          qlens: list[int] | None = None) -> tuple[Any, ...]:
    """q, the tables scattered over blocks, and the sequences' (start, q_len, seq_len); one query
    row a sequence unless qlens says more (a prompt chunk: the last qlens[i] of its lens[i])."""
    import torch

    h, _, d, bs = SHAPE
    qlens = qlens or [1] * len(lens)
    b, need = len(lens), -(-max(lens) // SHAPE[3])
    tables = torch.randperm(blocks, generator=gen)[:b * need].view(b, need).to(torch.int32)
    q = torch.randn(sum(qlens), h, d, generator=gen).to(dtype)
    starts = torch.tensor([0, *qlens[:-1]], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seqs = (starts, torch.tensor(qlens, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32))
    return q, tables.contiguous(), seqs


def attend(op: Any, out: Any, q: Any, pools: list[tuple[Any, Any]], tables: Any,
           seqs: tuple[Any, ...], i: int) -> None:
    """One call of op on round i: over the next (K, V) of pools."""
    kc, vc = pools[i % len(pools)]
    op(out, q, kc, vc, tables, *seqs, SHAPE[2] ** -0.5, 256, 0, 0.0, "auto")


def row(name: str, times: dict[str, list[float]], nbytes: int) -> str:
    """min and median of each variant, each against the first, and the last one's GB/s."""
    cols = [(min(t), statistics.median(t)) for t in times.values()]
    text = f"{name:34s}" + "".join(f" {lo:8.3f} {med:8.3f}" for lo, med in cols)
    for lo, med in cols[1:]:
        text += f" {cols[0][0] / lo:5.2f}x {cols[0][1] / med:5.2f}x"
    return text + "".join(f" {nbytes / lo / 1e6:6.1f}" for lo, _ in cols)


def header(names: list[str], unit: str = "GB/s") -> str:
    return (f"{'case':34s}" + "".join(f" {n[:17]:>17s}" for n in names)
            + "".join(f" {'x ' + n[:11]:>12s}" for n in names[1:]) + f" {unit:>6s}" * len(names))


def check_agree(outs: list[Any], exact: bool) -> None:
    """The variants' outputs agree bit for bit; where a change means to move the bits (exact False),
    within bfloat16's rounding of the output instead."""
    import torch

    first, *rest = outs
    for o in rest:
        if exact:
            assert torch.equal(first, o), "the kernels disagree"
        else:
            torch.testing.assert_close(o.float(), first.float(), atol=2e-2, rtol=2e-2)


def timed_hot(ops: dict[str, Any], runs: int, q: Any, blocks: int, tables: Any,
              seqs: tuple[Any, ...], gen: Any, exact: bool) -> dict[str, list[float]]:
    """Each op's ms per call over one random pool of blocks (q's dtype) that every call re-reads;
    checks that the ops agree (check_agree)."""
    import torch

    _, hkv, d, bs = SHAPE
    kc, vc = (torch.randn(blocks, bs, hkv, d, generator=gen).to(q.dtype) for _ in range(2))
    outs = {k: torch.empty_like(q) for k in ops}
    times = alternate({k: functools.partial(attend, op, outs[k], q, [(kc, vc)], tables, seqs)
                       for k, op in ops.items()}, runs)
    check_agree(list(outs.values()), exact)
    return times


def hot(ops: dict[str, Any], runs: int, dtype: Any, exact: bool) -> None:
    import torch

    h, hkv, d, bs = SHAPE
    print("hot: ms min, median; ratios to the first, min and median; GB/s of each at its min")
    print(header(list(ops)))
    gen = torch.Generator().manual_seed(0)
    for name, b, n, spare in [("32 x 408", 32, 408, 0), ("32 x 408, cache 20x", 32, 408, 20),
                              ("1 x 200", 1, 200, 0), ("1 x 500", 1, 500, 0),
                              ("1 x 1000", 1, 1000, 0), ("1 x 2000", 1, 2000, 0),
                              ("64 x 2048", 64, 2048, 0)]:
        blocks = b * -(-n // bs) * (1 + spare) + 1
        q, tables, seqs = batch([n] * b, blocks, gen, dtype)
        times = timed_hot(ops, runs, q, blocks, tables, seqs, gen, exact)
        print(row(name, times, b * n * hkv * d * 2 * dtype.itemsize))


def prompts(ops: dict[str, Any], runs: int, dtype: Any, exact: bool) -> None:
    """Prompt chunks, alone and in a served step's mix (decodes beside one), K/V hot as above."""
    import torch

    h, hkv, d, bs = SHAPE
    print("prompt chunks, hot: ms min, median; ratios to the first; GFLOP/s of each at its min")
    print(header(list(ops), "GFLOP/s"))
    gen = torch.Generator().manual_seed(2)
    for name, lens, qlens in [("prompt 256", [256], [256]), ("prompt 512", [512], [512]),
                              ("chunk 128 over 384", [512], [128]),
                              ("31 x 408 + prompt 256", [408] * 31 + [256], [1] * 31 + [256])]:
        blocks = len(lens) * -(-max(lens) // bs) + 1
        q, tables, seqs = batch(lens, blocks, gen, dtype, qlens)
        times = timed_hot(ops, runs, q, blocks, tables, seqs, gen, exact)
        # QK and PV, 2 flops a multiply-add, per query head and key each token sees
        flops = sum(4 * h * d * (n - q + t + 1) for n, q in zip(lens, qlens) for t in range(q))
        print(row(name, times, flops))


def dram(ops: dict[str, Any], runs: int, dtype: Any, exact: bool) -> None:
    import torch

    from engine.kv_cache import zeros_pool

    h, hkv, d, bs = SHAPE
    print(f"DRAM: each call the next layer's pool; {' / '.join(ops)} on 4 KB pages, then "
          "this tree on 2 MB pages")
    print(header([*ops, "this tree, 2 MB"]))
    gen = torch.Generator().manual_seed(1)
    for name, lens, layers in [("32 x 64..700 (step mix)", STEP_MIX, 30), ("1 x 2000", [2000], 30),
                               ("64 x 2048", [2048] * 64, 3)]:  # 100 MB a call: 3 pools of 200 MB
        blocks = 2 * sum(-(-n // bs) for n in lens)
        q, tables, seqs = batch(lens, blocks, gen, dtype)
        shape = (layers, 2, blocks, bs, hkv, d)
        small, huge = zeros_pool(shape, dtype, False), zeros_pool(shape, dtype, True)
        small.normal_(generator=gen)
        huge.copy_(small)
        fns = ops | {"this tree, 2 MB": ops["this tree"]}
        outs = {k: torch.empty_like(q) for k in fns}
        pools = {k: [(pool[i, 0], pool[i, 1]) for i in range(layers)]
                 for k, pool in [("4K", small), ("2M", huge)]}
        calls: dict[str, Callable[[int], None]] = {
            k: functools.partial(attend, op, outs[k], q, pools["2M" if "2 MB" in k else "4K"],
                                 tables, seqs) for k, op in fns.items()}
        times = alternate(calls, runs)
        for call in calls.values():
            call(0)  # every variant over layer 0, to compare
        check_agree(list(outs.values()), exact)
        print(row(name, times, sum(lens) * hkv * d * 2 * dtype.itemsize))
        del small, huge


def decode_rows(rev: str, runs: int, dtype_name: str = "bfloat16", exact: bool = True) -> None:
    """The three tables (the module docstring), this tree against rev, q and cache in dtype_name;
    exact: the two must agree bit for bit (else within the output's rounding: a change of
    arithmetic)."""
    import torch

    import kernels.cpu as native_cpu

    assert native_cpu.available(), "the native kernel did not build"
    ops = {rev: baseline_op(rev), "this tree": torch.ops.conveyor_cpu.paged_attention}
    dtype = getattr(torch, dtype_name)
    print(f"{dtype_name} decode rows, H={SHAPE[0]} Hkv={SHAPE[1]} D={SHAPE[2]} block={SHAPE[3]}, "
          f"isa auto, {runs} calls each, alternated")
    hot(ops, runs, dtype, exact)
    prompts(ops, runs, dtype, exact)
    dram(ops, runs, dtype, exact)
