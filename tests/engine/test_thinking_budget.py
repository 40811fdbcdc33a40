"""thinking_token_budget in the engine (engine/thinking.py): after exactly `budget` reasoning tokens
the end ids are forced, one a step, and the model goes on; tiny random Llama, greedy, stepped
in-process. And SmolLM2 itself closing its reasoning with `</think>` spelled as its tokenizer writes
it in context, which ends the budget by the spellings the gateway finds (gateway/reasoning.py)."""
from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from engine.core import EngineCore
from engine.offline import LLM
from gateway.reasoning import CLOSE, spellings
from shared.config import build_config
from shared.constraints import Constraint
from shared.errors import InvalidRequest
from shared.sampling import SamplingParams
from shared.tokenizer import encode
from tests.conftest import request_outputs
from tests.fakes import smollm2_tokenizer

PROMPT = list(range(3, 40))
MAX = 20
IDS = itertools.count()


@pytest.fixture(scope="module")
def core(tiny_llama_dir: Any) -> EngineCore:
    return EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=16,
                                   enable_prefix_caching=False))


def run(core: EngineCore, prompt: list[int] = PROMPT, **kw: Any) -> dict[int, list[Any]]:
    """-> per choice index, its output ids; under -1 - index its logprob entries; under -100 the
    prompt logprobs."""
    rid = f"r{next(IDS)}"
    core.add(rid, prompt, SamplingParams(**({"max_tokens": MAX, "ignore_eos": True,
                                             "temperature": 0} | kw)))
    out: dict[int, list[Any]] = {}
    while core.has_work():
        for o in request_outputs(core.step()):  # an Error fails the test
            out.setdefault(o.index, []).extend(o.new_token_ids)
            if o.logprobs:
                out.setdefault(-1 - o.index, []).extend(o.logprobs)
            if o.prompt_logprobs:
                out[-100] = o.prompt_logprobs
    return out


def unused(ref: list[int], k: int) -> list[int]:
    """k token ids the free run never writes: an end tag the model does not write by itself."""
    return [t for t in range(100, 200) if t not in ref][:k]


def test_the_end_ids_are_forced_exactly_at_the_budget_then_the_model_goes_on(
        core: EngineCore) -> None:
    ref = run(core)[0]
    end = unused(ref, 3)
    out = run(core, thinking_token_budget=5, reasoning_end_ids=end)[0]
    assert out[:5] == ref[:5]  # the reasoning is the model's own
    assert out[5:8] == end  # then the tag, forced
    assert len(out) == MAX and end[0] not in out[8:]  # and the model goes on, unforced
    free = run(core, PROMPT + out[:8], max_tokens=MAX - 8)[0]
    assert out[8:] == free  # the answer is what the model writes after the forced tag


def test_the_budget_counts_from_the_start_ids_when_the_output_writes_them(core: EngineCore) -> None:
    ref = run(core)[0]
    start, end = ref[2:4], unused(ref, 2)
    assert ref.index(start[0]) == 2  # the first time the start ids appear
    out = run(core, thinking_token_budget=3, reasoning_start_ids=start, reasoning_end_ids=end)[0]
    assert out[:7] == ref[:7] and out[7:9] == end  # 4 tokens up to the tag, then 3 reasoning tokens
    never = run(core, thinking_token_budget=3, reasoning_start_ids=unused(ref, 5)[3:],
                reasoning_end_ids=end)[0]
    assert never == ref  # no start ids in the output: no reasoning to cut


def test_an_end_tag_begun_or_written_by_the_model_is_not_forced_again(core: EngineCore) -> None:
    ref = run(core)[0]
    x, y = unused(ref, 2)
    begun = run(core, thinking_token_budget=5, reasoning_end_ids=[ref[4], x, y])[0]
    assert begun[:7] == [*ref[:5], x, y]  # ref[4] began the tag: only its rest is forced
    # closed at 3: nothing forced
    assert run(core, thinking_token_budget=5, reasoning_end_ids=ref[1:3])[0] == ref
    # no reasoning at all
    assert run(core, thinking_token_budget=0, reasoning_end_ids=[x])[0][:1] == [x]


def test_forced_tokens_report_the_models_own_logprobs(core: EngineCore) -> None:
    ref = run(core)[0]
    end = unused(ref, 2)
    got = run(core, thinking_token_budget=4, reasoning_end_ids=end, logprobs=0)
    out, lps = got[0], got[-1]
    assert out[4:6] == end and len(lps) == MAX
    scored = run(core, PROMPT + out[:6], max_tokens=1, prompt_logprobs=0)[-100]
    for j in (4, 5):  # the forced tokens: the model's log-softmax at their place, not 0
        want = scored[len(PROMPT) + j][0]
        assert math.isclose(lps[j][0], want, abs_tol=1e-4) and want < -1e-3


def test_each_sampled_sequence_keeps_its_own_budget(core: EngineCore) -> None:
    end = [150, 151]
    out = run(core, thinking_token_budget=6, reasoning_end_ids=end, temperature=1.0, seed=3, n=3)
    assert all(out[i][6:8] == end and len(out[i]) == MAX for i in range(3))
    # three samples, each forced at its own 6th token
    assert len({tuple(out[i][:6]) for i in range(3)}) > 1


@pytest.mark.parametrize(("kw", "param"), [
    ({"thinking_token_budget": 4}, "thinking_token_budget"),  # no end ids to force
    ({"thinking_token_budget": -1, "reasoning_end_ids": [5]}, "thinking_token_budget"),
    ({"thinking_token_budget": 4, "reasoning_end_ids": [5], "use_beam_search": True,
      "beam_width": 2,
      "temperature": 0}, "thinking_token_budget"),
    ({"thinking_token_budget": 4, "reasoning_end_ids": [5],
      "constraint": Constraint("regex", "a+")},
     "thinking_token_budget"),
    ({"reasoning_start_ids": [5]}, "reasoning_start_ids"),
    ({"reasoning_end_ids": ["5"]}, "reasoning_end_ids"),
    ({"reasoning_end_ids": list(range(33))}, "reasoning_end_ids"),
])
def test_a_budget_that_cannot_be_honoured_is_refused(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw)
    assert e.value.param == param


@pytest.mark.parametrize(("kw", "param"), [
    ({"reasoning_end_ids": (10**6,)}, "reasoning_end_ids"),
    ({"reasoning_end_ids": (5,), "reasoning_end_spellings": ((6,), (7, 10**6))},
     "reasoning_end_spellings"),
])
def test_end_ids_outside_the_vocabulary_are_refused_by_the_engine(core: EngineCore,
                                                                  kw: dict[str, Any],
                                                                  param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        core.add("bad", PROMPT, SamplingParams(thinking_token_budget=4, **kw))
    assert e.value.param == param and not core.has_work()


# Few-shot: SmolLM2 copies the examples' ` </think>`, which its tokenizer writes ` </`,
# `think`, `>` (after a space), not as `</think>` alone encodes (`</`, `think`, `>`). The
# prompt opened the block.
FEW_SHOT = ("Q: 2+2?\n<think> two plus two </think> 4\nQ: 3+3?\n<think> three plus three </think> "
            "6\nQ: 4+4?\n<think>")


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM("SmolLM2-135M-Instruct", dtype="float32", quantization="none",
               kv_cache_memory="64MiB", num_threads=1)


@pytest.mark.slow  # loads the real model in float32 (about a minute): out of `make check`
def test_smollm2_closing_its_reasoning_in_another_spelling_ends_the_budget(smollm2: LLM) -> None:
    tok = smollm2_tokenizer()
    prompt, end = tok.encode(FEW_SHOT, add_special_tokens=False), encode(tok, CLOSE,
                                                                         add_special_tokens=False)

    def generate(**kw: Any) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kw)
        return list(smollm2.generate([prompt], params, use_tqdm=False)[0].token_ids)

    free = generate()
    # The reference is the tokenizer's decode: the reasoning ends at the token whose prefix
    # holds `</think>`.
    closed = next(k for k in range(1, len(free) + 1) if CLOSE in tok.decode(free[:k]))
    # not the tag's own ids
    assert closed <= 8 and all(free[i:i + len(end)] != end for i in range(len(free)))
    budget = {"reasoning_end_ids": tuple(end), "reasoning_end_spellings": spellings(tok, CLOSE)}
    # The model closed it before the budget was spent: nothing is forced (ids alone forced
    # `</think>` at 12).
    assert generate(thinking_token_budget=12, **budget) == free
    # Spent inside the model's spelling, after ` </`: the forced end goes on with that spelling,
    # the model's own.
    assert generate(thinking_token_budget=closed - 2, **budget) == free
    # Spent before the model began one: the tag's own ids, forced.
    assert generate(thinking_token_budget=2, **budget)[2:2 + len(end)] == end
