"""The sampler's logits processing against transformers' own logits processors on the same logits;
logprobs against the model's log_softmax; its noise against torch's exponential_; seeded sampling
independent of the batch."""
from __future__ import annotations

from typing import cast

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine.core import EngineCore
from engine.request import Request
from engine.sampler import Sampler, argmax, exponential_, probs_of
from engine.sequence import Sequence
from shared.config import build_config
from shared.sampling import SamplingParams
from tests.conftest import request_outputs

V = 64
EOS = 2


def make(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence(Request("r", prompt, SamplingParams(temperature=0, max_tokens=32, **params),
                           eos_token_ids=(EOS,)))
    seq.token_ids += output
    return seq


def processed(req: Sequence, logits: torch.Tensor) -> torch.Tensor:
    return Sampler._process(logits.clone()[None], [req])[0]


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(V) * 3


PROMPT, OUTPUT = [5, 6, 7, 5, 9], [9, 10, 10, 11]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers(logits, penalty):
    req = make(PROMPT, OUTPUT, repetition_penalty=penalty)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUT]),
                                                    logits.clone()[None])[0]
    torch.testing.assert_close(processed(req, logits), ref)


def test_presence_and_frequency_penalties_follow_openai(logits):
    req = make(PROMPT, OUTPUT, presence_penalty=0.5, frequency_penalty=0.25)
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=V).float()
    ref = logits - 0.25 * counts - 0.5 * (counts > 0).float()  # prompt tokens are not penalised
    torch.testing.assert_close(processed(req, logits), ref)


def test_logit_bias_equals_transformers_sequence_bias(logits):
    bias = {3: 5.0, 17: -100.0, 40: 0.5}
    # JSON keys are strings
    req = make(PROMPT, OUTPUT, logit_bias={str(k): v for k, v in bias.items()})
    hf_bias = SequenceBiasLogitsProcessor([[[k], v] for k, v in bias.items()])
    ref = hf_bias(torch.tensor([PROMPT + OUTPUT]), logits.clone()[None])[0]
    torch.testing.assert_close(processed(req, logits), ref)


@pytest.mark.parametrize("produced", [0, 2, 3])
def test_min_tokens_equals_transformers(logits, produced):
    out = OUTPUT[:produced]
    req = make(PROMPT, out, min_tokens=3)
    proc = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, EOS)
    ref = proc(torch.tensor([PROMPT + out]), logits.clone()[None])[0]
    torch.testing.assert_close(processed(req, logits), ref)


def test_min_tokens_without_a_stop_id_leaves_the_logits_uncopied(logits):
    """ignore_eos with min_tokens (exact output lengths, as benchmarks ask) masks nothing: the
    sampler neither copies the [B, V] logits nor changes them, and a row that still masks gets
    its own copy."""
    free = make(PROMPT, OUTPUT[:1], min_tokens=3, ignore_eos=True)
    batch = logits.repeat(2, 1)
    assert Sampler._process(batch, [free, free]) is batch
    masked = make(PROMPT, OUTPUT[:1], min_tokens=3)
    out = Sampler._process(batch, [free, masked])
    # the caller's logits as given
    assert out is not batch and torch.equal(batch, logits.repeat(2, 1))
    assert torch.equal(out[0], logits) and out[1, EOS] == float("-inf")


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_keeps_the_tokens_transformers_keeps(logits, min_p):
    req = Sequence(Request("r", PROMPT + OUTPUT, SamplingParams(temperature=1.0, min_p=min_p)))
    probs = probs_of(logits.clone()[None], [req])[0]
    # transformers annotates input_ids torch.LongTensor, a type no tensor has; min-p
    # never reads them
    ids = cast(torch.LongTensor, torch.tensor([PROMPT + OUTPUT]))
    ref = MinPLogitsWarper(min_p)(ids, logits.clone()[None])[0]
    assert torch.equal(probs > 0, ref > float("-inf"))
    # the exponential race needs no renormalising
    torch.testing.assert_close(probs / probs.sum(), ref.softmax(-1))


def test_all_greedy_plain_batch_takes_the_fast_path(logits):
    reqs = [make(PROMPT, []) for _ in range(3)]
    s = Sampler()
    assert all(r.request.plain for r in reqs)
    assert s(logits.repeat(3, 1), reqs) == ([int(logits.argmax())] * 3, None)


def test_numpy_argmax_equals_torch_including_ties_and_strided_rows():
    torch.manual_seed(1)
    logits = torch.randn(9, 4096)
    logits[3, [7, 70, 700]] = 50.0  # equal maxima: the first one wins, as in torch
    logits[5] = 0.0
    wide = torch.randn(9, 8192)[:, ::2]  # a non-contiguous view, as a slice of a bigger buffer
    for x in (logits, wide, logits.double()):
        assert argmax(x) == x.argmax(dim=-1).tolist()
    assert argmax(logits)[3] == 7 and argmax(logits)[5] == 0


def test_logprobs_equal_log_softmax_of_the_model_logits(tiny_llama_dir):
    from tests.reference import hf_folder_model

    prompt = list(range(3, 30))
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=32, block_size=8))
    core.add("lp", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5,
                                          repetition_penalty=1.5))
    tokens: list[int] = []
    entries: list[list] = []
    while core.has_work():
        for o in request_outputs(core.step()):
            assert o.logprobs is not None  # asked for: one entry per token
            tokens += o.new_token_ids
            entries += o.logprobs
    model = hf_folder_model(tiny_llama_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        ref = logits.float().log_softmax(-1)
    for i, (tok, (lp, top)) in enumerate(zip(tokens, entries)):
        assert abs(lp - ref[i, tok].item()) < 1e-4
        vals, ids = ref[i].topk(5)
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(top, vals.tolist())) < 1e-4


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_16(tiny_llama_dir):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, seed=1234,
                            max_tokens=16, ignore_eos=True, presence_penalty=0.3)
    prompt = list(range(7, 40))
    results = []
    for others in (0, 16):
        core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=256, block_size=8))
        for k in range(others):
            core.add(f"o{k}", list(range(3 + k, 20 + 2 * k)),
                     SamplingParams(temperature=1.0 if k % 2 else 0.0, max_tokens=10 + k,
                                    ignore_eos=True))
        core.add("seeded", prompt, params)
        got: list[int] = []
        while core.has_work():
            got += [t for o in request_outputs(core.step()) if o.request_id == "seeded"
                    for t in o.new_token_ids]
        results.append(got)
    assert results[0] == results[1] and len(results[0]) == 16


@pytest.mark.parametrize("threads", [1, 2])
def test_exponential_draws_torchs_exponential_values_bit_for_bit(threads):
    """The sampler's noise is the values torch's own exponential_ draws from the same generator
    state, over a whole vocabulary row (seeded) and a [k + 1, V] block (the global generator, as
    speculative verification draws it): the exponential race samples exactly as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(4):
            theirs = torch.empty(49152).exponential_(generator=torch.Generator().manual_seed(seed))
            ours = torch.empty(49152)
            assert exponential_(ours, torch.Generator().manual_seed(seed)) is ours
            assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
        torch.manual_seed(7)
        theirs = torch.empty(5, 49152).exponential_()
        torch.manual_seed(7)
        ours = exponential_(torch.empty(5, 49152))
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    finally:
        torch.set_num_threads(before)
