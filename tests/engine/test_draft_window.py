"""The default speculation ("auto": prompt lookup for greedy requests on a CPU) and each sequence's
draft window: drafts go where they hold and stop where they fail, no step that carries a prompt's
prefill verifies drafts, and none of it changes a token."""
from __future__ import annotations

import random

from engine.core import EngineCore
from engine.speculative.window import MAX_PAUSE, DraftWindow
from shared.config import build_config
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.engine.test_speculative import repetitive_prompts

OPTIONS = {"num_blocks": 512, "block_size": 8}


def generate(folder, requests, **options) -> tuple[EngineCore, dict[str, list[int]]]:
    core = EngineCore(build_config(str(folder), **{**OPTIONS, **options}))
    for i, (prompt, params) in enumerate(requests):
        core.add(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    while core.has_work():
        for o in core.step():
            assert isinstance(o, RequestOutput), o
            out[o.request_id] += o.new_token_ids
    return core, out


def test_the_window_grows_while_drafts_hold_and_pauses_longer_after_each_miss():
    w = DraftWindow(8)
    assert w.drafts_now() == 8
    w.verified(8, 8)
    assert w.drafts_now() == 8  # capped at k
    w.verified(8, 3)
    assert w.drafts_now() == 3  # shrinks to what held
    w.verified(3, 3)
    assert w.drafts_now() == 6  # doubles while all hold
    pauses = []
    for _ in range(7):  # misses in a row: one draft after a pause that doubles, up to MAX_PAUSE
        w.verified(w.size, 0)
        steps = 0
        while w.drafts_now() == 0:
            steps += 1
        pauses.append(steps)
        assert w.size == 1
    assert pauses == [2, 4, 8, 16, 32, MAX_PAUSE, MAX_PAUSE]
    w.verified(1, 1)  # a hit ends the pauses
    assert w.drafts_now() == 2 and w.misses == 0


def test_auto_speculates_for_greedy_requests_only_and_changes_no_token(tiny_llama_dir):
    prompts = repetitive_prompts(8, 512, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    _, plain = generate(tiny_llama_dir, [(p, greedy) for p in prompts], speculative="none")
    core, out = generate(tiny_llama_dir, [(p, greedy) for p in prompts])  # the default: auto
    assert core.config.speculative.speculative == "auto"
    assert out == plain and core.stats()["total_spec_accepted_tokens"] > 0
    # one-token matches, so that sampled text finds guesses too: auto still verifies none of them,
    # "ngram" does
    core, _ = generate(tiny_llama_dir, [(p, sampled) for p in prompts], ngram_min=1)
    assert core.stats()["total_spec_verifications"] == 0
    core, _ = generate(tiny_llama_dir, [(p, sampled) for p in prompts], speculative="ngram",
                       ngram_min=1)
    assert core.stats()["total_spec_verifications"] > 0


def test_exact_lengths_speculate_and_stop_ids_under_min_tokens_do_not(tiny_llama_dir):
    """min_tokens masks stop ids, which verification does not: a request with stop ids drafts only
    past min_tokens; under ignore_eos (no stop ids, as benchmarks ask for exact lengths) it drafts
    from its first token."""
    prompts = repetitive_prompts(6, 512, seed=8)
    exact = SamplingParams(temperature=0, max_tokens=30, min_tokens=30, ignore_eos=True)
    _, plain = generate(tiny_llama_dir, [(p, exact) for p in prompts], speculative="none")
    core, out = generate(tiny_llama_dir, [(p, exact) for p in prompts])
    assert out == plain and core.stats()["total_spec_verifications"] > 0
    stops = SamplingParams(temperature=0, max_tokens=30, min_tokens=30, stop_token_ids=(2,))
    core, _ = generate(tiny_llama_dir, [(p, stops) for p in prompts])
    assert core.stats()["total_spec_verifications"] == 0


def test_a_sequence_whose_guesses_fail_soon_stops_drafting(tiny_llama_dir):
    """A prompt that repeats one phrase: lookup always has a guess, which the random model's own
    continuation almost never follows. Without the window it would verify drafts at every step."""
    rng = random.Random(5)
    phrase = [rng.randrange(3, 512) for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    core, out = generate(tiny_llama_dir, [(phrase * 8, params)], num_speculative_tokens=4)
    stats = core.stats()
    wasted = stats["total_spec_draft_tokens"] - stats["total_spec_accepted_tokens"]
    # the tokens it drafted and lost: at most a few windows' worth, not one per step
    assert stats["total_spec_verifications"] < 30 and wasted < 40, stats
    _, plain = generate(tiny_llama_dir, [(phrase * 8, params)], speculative="none")
    assert out == plain


def spy_on_drafts(monkeypatch) -> list[str]:
    """The request ids the scheduler asks for drafts, in order (those it plans with budget to
    spare: the rest get none)."""
    import engine.scheduler
    from engine.speculative import plan_drafts as plan

    asked: list[str] = []

    def spy(proposer, unit, ns, budget, *args):
        if budget > 1 and ns[0] == 1:  # a decoding sequence with budget to spare for drafts
            asked.append(unit[0].request.request_id)
        return plan(proposer, unit, ns, budget, *args)

    monkeypatch.setattr(engine.scheduler, "plan_drafts", spy)
    return asked


def test_no_drafts_take_a_prompts_budget(tiny_llama_dir, monkeypatch):
    """A new prompt's chunks get the budget before anyone's drafts: while more of it is left than a
    step's budget, the decoding sequence beside it gets no budget for drafts; after, it does
    again."""
    asked = spy_on_drafts(monkeypatch)
    core = EngineCore(build_config(str(tiny_llama_dir), **OPTIONS, max_num_batched_tokens=16))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    core.add("copy", [5, 6, 7, 8] * 6, params)
    while not asked:
        core.step()
    core.add("long", list(range(10, 90)), params)  # 80 tokens: several 16-token chunks
    long_seq = core.requests["long"].root
    asked.clear()
    while long_seq.num_prompt_tokens - long_seq.num_computed_tokens >= 16:
        core.step()
    assert asked == []
    while long_seq.num_computed_tokens < long_seq.num_prompt_tokens:
        core.step()
    asked.clear()
    for _ in range(3):
        core.step()
    assert asked.count("copy") == 3 and asked.count("long") == 3


def test_a_queue_without_seats_does_not_stop_drafts(tiny_llama_dir, monkeypatch):
    """Behind a full batch, waiting prompts take no budget this step, so they leave the drafts
    alone: a saturated server still speculates."""
    asked = spy_on_drafts(monkeypatch)
    core = EngineCore(build_config(str(tiny_llama_dir), **OPTIONS, max_num_seqs=1,
                                   max_num_batched_tokens=64))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    core.add("first", [5, 6, 7, 8] * 6, params)
    core.step()  # its prompt
    core.add("queued", list(range(10, 60)), params)  # no seat until "first" ends
    for _ in range(5):
        core.step()
    assert asked.count("first") == 5 and core.requests["queued"].root.num_computed_tokens == 0
