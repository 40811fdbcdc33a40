"""A failure inside the engine's step ends the requests it belongs to, never the others and never
the engine: faults injected into one request's sampling, into one request's beam scoring, and into
the shared forward. Every block comes back either way."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from engine import groups
from engine.core import EngineCore
from engine.sampler import Sampler
from shared.config import build_config
from shared.protocol import Error, RequestOutput
from shared.sampling import SamplingParams

GOOD = {
    "greedy": ([5, 6, 7, 8, 9, 10, 11],
               SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)),
    "seeded": ([40, 41, 42, 43], SamplingParams(temperature=0.8, seed=7, max_tokens=14,
                                                ignore_eos=True)),
    "logprobs": ([90, 3, 17] * 5, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                 logprobs=3)),
    "beams": ([12, 13, 14, 15, 16],
              SamplingParams(max_tokens=8, use_beam_search=True, beam_width=3, n=2,
                                                    ignore_eos=True)),
}


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> tuple[dict[tuple[str, int], list[int]], dict[str, str]]:
    """-> tokens per (request, choice), and the error message per failed request."""
    for rid, (prompt, params) in requests.items():
        core.add(rid, prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    errors: dict[str, str] = {}
    for _ in range(500):
        if not core.has_work():
            break
        for out in core.step():
            if isinstance(out, Error):
                assert out.request_id is not None and out.request_id not in errors
                errors[out.request_id] = out.message
            else:
                assert isinstance(out, RequestOutput)
                tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    assert not core.has_work()
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0} and not core.requests
    return tokens, errors


@pytest.fixture
def make_core(tiny_llama_dir) -> Callable[[], EngineCore]:
    return lambda: EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=8))


def test_a_request_whose_sampling_raises_fails_alone(make_core, monkeypatch):
    ref, _ = run(make_core(), GOOD)
    process = Sampler._process

    def poisoned(logits, seqs):
        if any(s.request.request_id == "bad" for s in seqs):
            raise RuntimeError("poisoned logits processor")
        return process(logits, seqs)

    monkeypatch.setattr(Sampler, "_process", staticmethod(poisoned))
    bad = ([20, 21, 22], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                        repetition_penalty=1.3))
    tokens, errors = run(make_core(), {**GOOD, "bad": bad})
    assert set(errors) == {"bad"} and "poisoned logits processor" in errors["bad"]
    assert tokens == ref  # the others: every token as without the failing request


def test_beam_scoring_that_raises_fails_that_request_alone(make_core, monkeypatch):
    ref, _ = run(make_core(), GOOD)
    beam_step = groups.beam_step

    def poisoned(cands, max_model_len):
        if cands[0][0].request.request_id == "bad-beams":
            raise OverflowError("(34, 'Numerical result out of range')")
        return beam_step(cands, max_model_len)

    monkeypatch.setattr(groups, "beam_step", poisoned)
    tokens, errors = run(make_core(), {**GOOD, "bad-beams": ([70, 71, 72], GOOD["beams"][1])})
    assert set(errors) == {"bad-beams"} and "OverflowError" in errors["bad-beams"]
    assert tokens == ref


def test_a_failed_forward_fails_only_the_requests_of_its_step(make_core, monkeypatch):
    core = make_core()
    model = core.runner.model
    forward = model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the second decode step of the first requests
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    first = {k: GOOD[k] for k in ("greedy", "seeded")}
    _, errors = run(core, first)
    assert set(errors) == set(first) and all("device lost" in m for m in errors.values())
    late = {k: GOOD[k] for k in ("logprobs", "beams")}
    tokens, errors = run(core, late)  # the same engine serves new requests as usual
    assert not errors and tokens == run(make_core(), late)[0]
