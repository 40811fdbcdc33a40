"""The engine's door: what only the engine knows (the vocabulary, its sequence cap, its KV pool) is
checked when a request arrives, so nothing it carries can raise later inside a step."""
from __future__ import annotations

import pytest

from engine.core import EngineCore
from shared.config import build_config
from shared.errors import InvalidRequest
from shared.sampling import SamplingParams

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def core(tiny_llama_dir) -> EngineCore:
    return EngineCore(build_config(str(tiny_llama_dir), num_blocks=32, block_size=8,
                                   max_num_seqs=8))


@pytest.mark.parametrize("prompt,params,param", [
    # The first case of issue #14: an id past the vocabulary once stopped the engine in the sampler.
    (PROMPT, SamplingParams(min_tokens=1, stop_token_ids=(100_000,)), "stop_token_ids"),
    # logit_bias in its wire form, a {"id": bias} dict that __post_init__ makes the declared pairs
    (PROMPT, SamplingParams(logit_bias={"512": 1.0}), "logit_bias"),  # type: ignore[arg-type]
    ([5, 512], SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    (PROMPT, SamplingParams(n=9), "n"),
    (PROMPT, SamplingParams(n=2, best_of=9), "best_of"),
    (PROMPT, SamplingParams(use_beam_search=True, beam_width=9), "beam_width"),
    # 4 beams of up to 4 + 100 tokens need 4 x 13 blocks of 8; the pool has 32.
    (PROMPT, SamplingParams(use_beam_search=True, beam_width=4, max_tokens=100), "beam_width"),
])
def test_the_door_refuses_what_can_never_run_and_names_the_field(core, prompt, params, param):
    vocab = core.model_config.vocab_size
    assert vocab == 512  # the ids above are chosen against the tiny model's vocabulary
    with pytest.raises(InvalidRequest) as err:
        core.add("r", prompt, params)
    assert err.value.param == param
    assert not core.has_work() and "r" not in core.requests


def test_the_limits_themselves_are_accepted_and_run(core):
    top = core.model_config.vocab_size - 1
    edge = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=(top,), min_tokens=1,
                          logit_bias={str(top): -1.0})  # type: ignore[arg-type]
    core.add("edge", PROMPT + [top], edge)
    core.add("beams", PROMPT, SamplingParams(use_beam_search=True, beam_width=4, max_tokens=60,
                                             ignore_eos=True))
    core.add("n8", PROMPT, SamplingParams(temperature=1.0, n=8, max_tokens=3))
    finished = set()
    while core.has_work():
        finished |= {o.request_id for o in core.step() if o.finished}
    assert finished == {"edge", "beams", "n8"} and core.block_manager.num_free_blocks == 32


def test_prompt_logprobs_too_large_for_one_message_are_refused(core, monkeypatch):
    """One request's prompt logprobs travel in one OUTPUTS message: their size is capped at the
    door."""
    monkeypatch.setattr("engine.admission.MAX_PROMPT_LOGPROB_PAIRS", 3 * len(PROMPT))
    with pytest.raises(InvalidRequest) as err:
        core.add("r", PROMPT, SamplingParams(prompt_logprobs=3))
    assert err.value.param == "prompt_logprobs" and not core.has_work()
    core.add("ok", PROMPT, SamplingParams(prompt_logprobs=2, max_tokens=1))
    while core.has_work():
        core.step()
