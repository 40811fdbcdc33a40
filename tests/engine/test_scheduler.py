"""Scheduler and block manager on fake requests: no model, exact state."""
from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step import StepOutput
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams

EOS = 2


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0,
                 arrival: float = 0.0) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(Request(rid, list(range(10, 10 + prompt_len)), params, priority, arrival,
                            (EOS,)))


def run_step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    s.update(plan, StepOutput([token] * plan.num_sampled))
    return plan


def make_scheduler(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size), 10_000)


@pytest.mark.parametrize("policy", ["chunked", "prefill_first", "mixed"])
def test_budget_and_seq_cap_hold_every_step(policy):
    rng = random.Random(0)
    s = make_scheduler(num_blocks=200, block_size=4, max_num_batched_tokens=32, max_num_seqs=5,
                       prefill_policy=policy)
    for i in range(20):
        s.add(make_request(f"r{i}", rng.randint(1, 70), max_tokens=rng.randint(1, 12), arrival=i))
    steps = 0
    while s.has_work():
        plan = run_step(s)
        assert plan.num_tokens <= 32
        assert len(plan.seqs) <= 5
        steps += 1
        assert steps < 1000
    assert s.bm.num_free_blocks == 200


def test_chunked_prefill_of_2000_tokens_never_starves_running_decodes():
    s = make_scheduler(num_blocks=1024, max_num_batched_tokens=256, max_num_seqs=8)
    for i in range(3):
        s.add(make_request(f"chat{i}", 5, max_tokens=200, arrival=i))
    run_step(s)  # the three chats are prefilled and decoding
    s.add(make_request("doc", 2000, arrival=10))
    chunks = []
    while any(r.request.request_id == "doc" and r.num_computed_tokens < 2000
              for r in s.running + s.waiting):
        plan = run_step(s)
        ids = dict(zip((r.request.request_id for r in plan.seqs), plan.num_new_tokens))
        assert all(ids[f"chat{i}"] == 1 for i in range(3))  # every decode gets its token every step
        chunks.append(ids.get("doc", 0))
    assert chunks == [253] * 7 + [2000 - 253 * 7]


def test_prefill_first_gives_new_prompts_a_step_of_their_own():
    s = make_scheduler(max_num_batched_tokens=64, prefill_policy="prefill_first")
    s.add(make_request("a", 5, max_tokens=10, arrival=0))
    run_step(s)
    s.add(make_request("b", 5, arrival=1))
    plan = run_step(s)
    assert [r.request.request_id for r in plan.seqs] == ["b"]
    plan = run_step(s)
    assert sorted(r.request.request_id for r in plan.seqs) == ["a", "b"]


def test_mixed_admits_only_whole_prompts_beside_decodes():
    s = make_scheduler(max_num_batched_tokens=10, prefill_policy="mixed")
    s.add(make_request("a", 4, max_tokens=10, arrival=0))
    run_step(s)
    s.add(make_request("b", 12, arrival=1))  # does not fit beside a's decode: waits, is not cut
    plan = run_step(s)
    assert [r.request.request_id for r in plan.seqs] == ["a"]


def test_priority_orders_admission():
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=1)
    s.add(make_request("late-urgent", 4, max_tokens=1, priority=-1, arrival=5))
    s.add(make_request("early", 4, max_tokens=1, priority=0, arrival=0))
    assert [r.request.request_id for r in run_step(s).seqs] == ["late-urgent"]
    assert [r.request.request_id for r in run_step(s).seqs] == ["early"]


def test_preemption_frees_blocks_and_request_resumes_to_completion():
    # 6 blocks of 4 tokens; three requests of 7 prompt tokens each need 2 blocks, then grow.
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 7, max_tokens=6, arrival=i) for i in range(3)]
    for r in reqs:
        s.add(r)
    preempted = []
    while s.has_work():
        preempted += [r.request.request_id for r in run_step(s).preempted]
    assert preempted and preempted[0] == "r2"  # the latest arrival goes first
    assert all(r.status == SequenceStatus.FINISHED_LENGTH and r.num_output_tokens == 6
               for r in reqs)
    assert s.bm.num_free_blocks == 6 and s.bm.ref_counts == [0] * 6


def test_blocks_come_from_the_free_list_in_its_order():
    order = [5, 2, 7, 0, 1, 3, 4, 6]
    bm = BlockManager(8, 4, order)
    r = make_request("x", 13)
    bm.allocate(r, 13)
    assert r.block_table == [5, 2, 7, 0]
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.block_table == []


def test_schedule_interval_admits_only_every_nth_step():
    s = make_scheduler(max_num_batched_tokens=64, schedule_interval=3)
    s.add(make_request("a", 4, max_tokens=30, arrival=0))
    run_step(s)  # step 1: admitted at once (nothing was running)
    admitted_at: dict[str, int] = {}
    for step in range(2, 9):
        s.add(make_request(f"n{step}", 4, max_tokens=30, arrival=step))
        plan = run_step(s)
        for r, n in zip(plan.seqs, plan.num_new_tokens):
            if n > 1:
                admitted_at.setdefault(r.request.request_id, step)
    assert set(admitted_at.values()) == {4, 7}  # steps 1, 4, 7 open the door


def test_waiting_served_ratio_holds_admissions_until_enough_wait():
    s = make_scheduler(max_num_batched_tokens=64, waiting_served_ratio=2.0)
    s.add(make_request("a", 4, max_tokens=50, arrival=0))
    run_step(s)
    s.add(make_request("b", 4, max_tokens=50, arrival=1))
    assert [r.request.request_id for r in run_step(s).seqs] == ["a"]  # 1 waiting < 2 x 1 running
    s.add(make_request("c", 4, max_tokens=50, arrival=2))
    assert sorted(r.request.request_id for r in run_step(s).seqs) == ["a", "b", "c"]


def test_long_prompt_cap_lets_short_prompts_overtake():
    s = make_scheduler(num_blocks=512, max_num_batched_tokens=64, max_long_prefills=1,
                       long_prefill_threshold=32)
    s.add(make_request("long1", 400, arrival=0))
    s.add(make_request("long2", 400, arrival=1))
    s.add(make_request("short", 10, arrival=2))
    plan = run_step(s)
    # long1's chunk is capped while others wait; long2 may not prefill beside it; short overtakes.
    assert dict(zip((r.request.request_id for r in plan.seqs),
                    plan.num_new_tokens)) == {"long1": 32, "short": 10}
    s2 = make_scheduler(num_blocks=512, max_num_batched_tokens=64, long_prefill_threshold=32)
    s2.add(make_request("alone", 400))
    # with nobody waiting, a long prompt uses the whole budget
    assert run_step(s2).num_new_tokens == [64]


def test_a_prompt_is_long_only_past_half_the_step_budget_by_default():
    """The default threshold: half the budget, at least 256. With a 2,048-token budget a burst of
    512-token prompts prefills whole, four to a step; with 512, the 256 cap and one-at-a-time
    hold."""
    assert [SchedulerConfig(max_num_batched_tokens=b).long_prompt_tokens
            for b in (64, 512, 2048)] == [256, 256, 1024]
    assert SchedulerConfig(max_num_batched_tokens=2048,
                           long_prefill_threshold=100).long_prompt_tokens == 100
    big = make_scheduler(num_blocks=1024, max_num_batched_tokens=2048)
    for i in range(5):
        big.add(make_request(f"p{i}", 512, arrival=i))
    assert run_step(big).num_new_tokens == [512] * 4
    small = make_scheduler(num_blocks=1024, max_num_batched_tokens=512)
    for i in range(3):
        small.add(make_request(f"p{i}", 400, arrival=i))
    assert run_step(small).num_new_tokens == [256]


def test_swapped_requests_resume_before_new_admissions_and_are_not_preempted_again_at_once():
    config = SchedulerConfig(max_num_batched_tokens=64)
    s = Scheduler(config, BlockManager(6, 4, num_cpu_blocks=16), 10_000)
    reqs = [make_request(f"r{i}", 7, max_tokens=6, arrival=i) for i in range(3)]
    for r in reqs:
        s.add(r)
    swapped_out, steps, checked = [], 0, 0
    while s.has_work():
        steps += 1
        if steps == 3:
            reqs.append(make_request("late", 3, max_tokens=6, arrival=10))
            s.add(reqs[-1])
        waiting = {r.request.request_id for r in s.waiting}
        plan = s.schedule()
        if s.swapped:  # nobody new is admitted while a swapped request still waits to come back
            checked += 1
            assert not waiting & {r.request.request_id for r in plan.seqs}
        swapped_out += [r.request.request_id for r in plan.preempted]
        resumed = {r.request.request_id for r in plan.seqs if r.just_resumed}
        assert not resumed & {r.request.request_id for r in plan.preempted}
        s.update(plan, StepOutput([7] * plan.num_sampled))
    assert swapped_out and checked and s.num_preemptions == {"swap": len(swapped_out),
                                                             "recompute": 0}
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert s.bm.num_free_blocks == 6 and s.bm.cpu.num_free == 16
