"""The dashboard's data (engine/observe/dashboard.py) and step traces (engine/observe/trace.py),
on an in-process engine whose small KV pool forces swaps and whose requests share prefixes and
blocks (n=4)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core import EngineCore
from engine.observe.dashboard import FREE_CACHED, FREE_EMPTY, Observer
from engine.observe.trace import PHASES, REQUESTS_PID, STEPS_PID, Tracer
from shared.config import build_config
from shared.protocol import Observed, RequestOutput, decode, encode
from shared.sampling import SamplingParams

PREFIX = list(range(10, 42))  # 4 blocks of 8, shared by every prompt


def make_core(tiny_llama_dir: Path) -> EngineCore:
    # 24 blocks of 8 for five requests of up to 32 + 8 + 40 tokens (10 blocks each): they
    # cannot all run.
    return EngineCore(build_config(str(tiny_llama_dir), num_blocks=24, block_size=8,
                                   swap_space="64KiB", preemption_mode="swap", num_threads=1))


def add_workload(core: EngineCore) -> None:
    for i in range(4):
        core.add(f"r{i}", PREFIX + [100 + i] * 8,
                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    core.add("n4", PREFIX + [7] * 3,
             SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=24, ignore_eos=True))


def run(core: EngineCore,
        observer: Observer | None = None) -> tuple[dict[tuple[str, int], list[int]], list[dict]]:
    """Steps until idle. -> tokens per (request, choice); the snapshots taken after every step."""
    tokens: dict[tuple[str, int], list[int]] = {}
    snapshots = []
    while core.has_work():
        outs = core.step()
        for out in outs:
            assert isinstance(out, RequestOutput)
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        if observer is not None:
            observer.on_step(outs)
            snapshots.append(observer.snapshot())
    return tokens, snapshots


def test_observing_changes_no_output_and_snapshots_agree_with_the_pools(
        tiny_llama_dir: Path) -> None:
    plain = make_core(tiny_llama_dir)
    add_workload(plain)
    expected, _ = run(plain)

    core = make_core(tiny_llama_dir)
    observer = Observer(core)
    observer.subscribe(b"viewer", 5.0)
    add_workload(core)
    got, snapshots = run(core, observer)
    assert got == expected

    assert core.stats()["num_preemptions_swap"] > 0
    for snap in snapshots:
        stats = snap["stats"]
        held = [h for h in snap["blocks"] if h >= 0]
        assert len(held) == stats["num_blocks"] - stats["num_free_blocks"]
        assert sum(h == FREE_CACHED for h in snap["blocks"]) <= stats["num_cached_device_blocks"]
        assert snap["counts"] == {"running": stats["num_running"], "swapped": stats["num_swapped"],
                                  "waiting": stats["num_waiting"]}
        assert [r[1] for r in snap["seqs"]].count("swapped") == stats["num_swapped"]
        for block, rc in snap["shared"]:
            assert snap["blocks"][block] >= 0 and rc > 1
    assert any(s["counts"]["swapped"] for s in snapshots), "the pool never forced a swap"
    assert any(r[0].startswith("n4#") for s in snapshots for r in s["seqs"])
    assert any(s["shared"] for s in snapshots), "neither the prefix nor n=4 shared a block"
    # finished prompts stay as cached prefixes
    assert any(h == FREE_CACHED for h in snapshots[-1]["blocks"])
    assert all(h in (FREE_EMPTY, FREE_CACHED) for h in snapshots[-1]["blocks"])


def test_observed_goes_over_the_wire_bounded_and_lapses(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    observer = Observer(core)
    observer.subscribe(b"viewer", 0.5)
    observer.on_step([])  # the loop after a step that had nothing to plan: no row, no error
    assert observer.due(force=True)[0][1].steps == []
    add_workload(core)
    steps_seen: list[int] = []
    while core.has_work():
        observer.on_step(core.step())
        for client, msg in observer.due(force=not core.has_work()):
            assert client == b"viewer"
            back = decode(encode(msg))
            assert isinstance(back, Observed) and back.steps == msg.steps
            steps_seen += [int(r[0]) for r in back.steps]
        observer.subscribe(b"viewer", 0.5)  # the gateway renews while a viewer is connected
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] == core.num_steps
    observer.subscribe(b"viewer", 0)
    assert not observer.watchers and observer.due() == []


def test_trace_has_one_span_per_step_with_its_phases_and_nested_request_lifecycles(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    core = make_core(tiny_llama_dir)
    core.set_tracer(Tracer())
    add_workload(core)
    run(core)
    assert core.tracer is not None
    path = tmp_path / "trace.json"
    core.tracer.write(path)
    events = json.loads(path.read_text())["traceEvents"]

    steps = sorted((e for e in events if e["pid"] == STEPS_PID and e["name"].startswith("step ")),
                   key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == [f"step {i}" for i in range(1, core.num_steps + 1)]
    phases = [e for e in events if e["pid"] == STEPS_PID and e["ph"] == "X" and e["name"] in PHASES]
    assert len(phases) == len(PHASES) * len(steps)
    for step in steps:
        inside = sorted((p for p in phases if step["ts"] <= p["ts"] < step["ts"] + step["dur"]),
                        key=lambda p: p["ts"])
        assert [p["name"] for p in inside] == list(PHASES)
        assert inside[-1]["ts"] + inside[-1]["dur"] == pytest.approx(step["ts"] + step["dur"],
                                                                     abs=1.0)

    names = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"
             and e["pid"] == REQUESTS_PID and e["name"] == "thread_name"}
    assert set(names) == {"r0", "r1", "r2", "r3", "n4"}
    kinds: set[str] = set()
    for rid, tid in names.items():
        mine = [e for e in events if e["pid"] == REQUESTS_PID and e["tid"] == tid]
        (whole,) = [e for e in mine if e["name"] == f"request {rid}"]
        children = [e for e in mine if e is not whole and e["ph"] == "X"]
        for child in children:  # nest in time: inside the request's span
            assert whole["ts"] <= child["ts"]
            assert child["ts"] + child["dur"] <= whole["ts"] + whole["dur"] + 1e-3
        kinds |= {c["name"] for c in children}
        assert {"queued", "prefill", "decode"} <= {c["name"] for c in children}
        assert [e["name"] for e in mine if e["ph"] == "i"] == ["finished"]
    assert "swapped" in kinds
