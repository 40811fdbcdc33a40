"""Speculative decoding changes how many steps a request takes, never what it outputs: greedy
output is identical with speculation on and off (each proposer, alone and mixed with plain
requests, under memory pressure), and sampled output keeps the model's distribution (checked
against probabilities computed by transformers, with a negative control that a broken acceptance
rule fails)."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

import engine.speculative.verify as verify_module
from engine.core import EngineCore
from engine.speculative.ngram import propose_ngram
from shared.config import build_config
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.reference import hf_folder_model

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def run(folder, requests, **options) -> tuple[EngineCore, dict[str, list[int]]]:
    """requests: [(prompt ids, params)] -> (the core after the run, output ids per request)."""
    options = {"num_blocks": 256, "block_size": 8, "speculative": "none", **options}
    core = EngineCore(build_config(str(folder), **options))
    for i, (prompt, params) in enumerate(requests):
        core.add(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    while core.has_work():
        for o in core.step():
            assert isinstance(o, RequestOutput), o  # an Error here fails the test
            out[o.request_id] += o.new_token_ids
        for req in core.scheduler.running:  # rejected drafts never keep a block
            assert len(req.block_table) <= core.block_manager.blocks_for(req.num_tokens)
    return core, out


def repetitive_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup finds matches (as in edits and summaries)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        prompts.append([rng.randrange(3, vocab)
                        for _ in range(rng.randint(0, 5))] + phrase * rng.randint(2, 4))
    return prompts


# ------------------------------------------------------------------ proposals
def test_ngram_proposes_what_followed_the_latest_longest_match():
    # latest of two matches
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    # "2 3" beats the later "3"
    assert propose_ngram([5, 2, 3, 8, 4, 3, 6, 2, 3], 3, 1, 2) == [8, 4, 3]
    # n = 1 only: the latest "3"
    assert propose_ngram([5, 2, 3, 8, 4, 3, 6, 2, 3], 3, 1, 1) == [6, 2, 3]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([4, 4], 5, 1, 3) == [4]  # capped by the tokens that exist
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: "256, 1" packs bytes that contain 1's bytes at an
    # odd offset; a byte search must not report that straddling hit as an occurrence of 1.
    assert propose_ngram([256, 1, 7, 9, 1], 2, 1, 1) == [7, 9]
    assert propose_ngram([256, 0, 7, 9, 1], 2, 1, 1) == []


# ------------------------------------------------------------------ greedy: identical
def mixed_workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Speculating requests next to ones that take the plain path (opt-out, penalties, n > 1,
    logprobs), so verification and plain sampling share steps."""
    prompts = repetitive_prompts(10, vocab)
    plain_variants = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2, best_of=2),
    ]
    reqs = [(p, GREEDY) for p in prompts]
    reqs += [(p, params) for p, params in zip(repetitive_prompts(4, vocab, seed=1), plain_variants)]
    # near max_tokens
    reqs.append((prompts[0][:5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    return reqs


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, make_tiny_checkpoint):
    """Another tiny Llama with the same vocabulary: a draft whose guesses are mostly wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft"), LlamaConfig,
                                LlamaForCausalLM, seed=5, num_hidden_layers=1)


@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-other"])
def test_greedy_output_identical_with_speculation(tiny_llama_dir, tiny_draft_dir, proposer):
    reqs = mixed_workload(vocab=512)
    _, expected = run(tiny_llama_dir, reqs)
    spec = {"ngram": "ngram", "draft-self": f"draft:{tiny_llama_dir}",
            "draft-other": f"draft:{tiny_draft_dir}"}
    core, out = run(tiny_llama_dir, reqs, speculative=spec[proposer], num_speculative_tokens=3)
    assert out == expected
    stats = core.stats()
    assert stats["total_spec_verifications"] > 0 and stats["total_spec_draft_tokens"] > 0
    if proposer == "draft-self":  # the target proposing for itself is always right
        assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 3
    if proposer == "ngram":
        assert stats["total_spec_accepted_tokens"] > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_seeded_sampling_gives_the_same_tokens_with_prompt_lookup(tiny_llama_dir):
    """Prompt lookup verifies by sampling each position with the noise plain decoding uses there, so
    a seeded request's tokens are the same with and without speculation, alone or in a batch."""
    reqs = [(p, SamplingParams(temperature=0.3, top_p=0.9, seed=100 + i, max_tokens=32,
                               ignore_eos=True))
            for i, p in enumerate(repetitive_prompts(12, 512, seed=4))]
    _, expected = run(tiny_llama_dir, reqs)
    core, out = run(tiny_llama_dir, reqs, speculative="ngram", num_speculative_tokens=3)
    assert out == expected
    assert core.stats()["total_spec_accepted_tokens"] > 0
    _, alone = run(tiny_llama_dir, reqs[3:4], speculative="ngram", num_speculative_tokens=5)
    assert alone["r0"] == expected["r3"]


@pytest.mark.parametrize("mode,cpu_blocks", [("swap", 200), ("recompute", 0)])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculating_requests_survive_preemption(tiny_llama_dir, tiny_draft_dir, proposer, mode,
                                                 cpu_blocks):
    rng = random.Random(3)
    reqs = [(p, SamplingParams(temperature=0, max_tokens=rng.randint(8, 30), ignore_eos=True))
            for p in repetitive_prompts(40, 512, seed=3)]
    _, expected = run(tiny_llama_dir, reqs, num_blocks=1024)
    spec = "ngram" if proposer == "ngram" else f"draft:{tiny_draft_dir}"
    core, out = run(tiny_llama_dir, reqs, num_blocks=40, num_cpu_blocks=cpu_blocks,
                    preemption_mode=mode, speculative=spec, num_speculative_tokens=4,
                    max_num_batched_tokens=128)
    assert out == expected
    stats = core.stats()
    assert stats["num_preemptions_" + mode] > 0 and stats["total_spec_verifications"] > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert core.block_manager.cpu.num_free == core.block_manager.cpu.num_blocks


@pytest.mark.slow
def test_smollm2_greedy_identical_with_ngram(smollm2_source):
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_source)
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    texts = [f"Rename the functions to plus and minus:\n{code}\nAnswer:\n",
             "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat"]
    reqs = [(tok.encode(t), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            for t in texts]
    # float32 pinned (auto is bfloat16 on AMX CPUs): exact equality across batch shapes needs it.
    options = {"kv_cache_memory": "256MiB", "block_size": 16, "dtype": "float32"}
    plain_core, expected = run("SmolLM2-135M-Instruct", reqs, **options)
    core, out = run("SmolLM2-135M-Instruct", reqs, speculative="ngram", **options)
    assert out == expected
    assert core.stats()["total_spec_accepted_tokens"] > 0
    assert core.num_steps < plain_core.num_steps


# ------------------------------------------------------------------ sampled: same distribution
VOCAB = 16
# A phrase, the target's greedy continuation of it, and the phrase again: prompt lookup proposes the
# continuation, which the target often (not always) samples.
PROMPT = [3, 4, 5, 6, 7, 8, 5, 7, 9, 9, 9, 3, 4, 5, 6, 7]
NUM_SAMPLES = 3000
# the first token comes from the prompt's step; the next ones from verification steps
MAX_TOKENS = 5
CHECKED = (1, 2, 3)  # generated positions whose marginals are tested


@pytest.fixture(scope="module")
def small_vocab_dirs(tmp_path_factory, make_tiny_checkpoint):
    """A target over 16 tokens with peaked distributions (large weights), and a draft that is the
    target with noise added: close, not equal, so drafts are accepted often and rejected often."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=VOCAB, initializer_range=0.6, tie_word_embeddings=False)
    target = make_tiny_checkpoint(tmp_path_factory.mktemp("small-vocab"), LlamaConfig,
                                  LlamaForCausalLM, seed=11, **kw)
    draft_dir = tmp_path_factory.mktemp("small-vocab-draft")
    model = hf_folder_model(target)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.05)
    model.save_pretrained(draft_dir, safe_serialization=True)
    return target, draft_dir


def exact_marginals(folder, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """P(token t | prompt) for t = 1..steps, marginalised over the tokens before it, from
    transformers' model by enumerating every prefix (VOCAB ** (steps - 1) of them)."""
    model = hf_folder_model(folder)
    prefixes, weights = [list(prompt)], torch.ones(1, dtype=torch.float64)
    marginals = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor(prefixes)).logits[:, -1].double()  # [P, V]
            joint = weights[:, None] * logits.softmax(-1)  # [P, V]
            marginals.append(joint.sum(0))
            prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
            weights = joint.flatten()
    return marginals


def chi_square(counts: Counter, expected_p: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected fewer than 5 times are pooled."""
    stat, dof, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for t in range(VOCAB):
        e = float(expected_p[t]) * n
        if e < 5:
            pool_o, pool_e = pool_o + counts[t], pool_e + e
            continue
        stat += (counts[t] - e) ** 2 / e
        dof += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        dof += 1
    return stat, dof


def critical_value(dof: int, z: float = 3.72) -> float:
    """Chi-square quantile by Wilson-Hilferty; z = 3.72 is the 0.9999 normal quantile."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def sample(target, **options) -> tuple[list[list[int]], dict[str, float]]:
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=s)
              for s in range(NUM_SAMPLES)]
    core, out = run(target, [(PROMPT, p) for p in params], max_num_seqs=256,
                    max_num_batched_tokens=4096, num_blocks=2048, **options)
    return list(out.values()), core.stats()


def max_excess(samples: list[list[int]], marginals: list[torch.Tensor]) -> float:
    """The largest chi-square statistic over the checked positions, as a multiple of its
    0.9999 quantile (so < 1 passes; with three positions a correct sampler fails about 3 times
    in 10,000)."""
    worst = 0.0
    for pos in CHECKED:
        stat, dof = chi_square(Counter(s[pos] for s in samples), marginals[pos], len(samples))
        worst = max(worst, stat / critical_value(dof))
    return worst


def accept_all(p, drafts, q, req):
    """Broken: keeps every draft."""
    return len(drafts), verify_module._draw(p[len(drafts)], None)


def resample_from_p(p, drafts, q, req):
    """Broken: at a rejection, samples from p instead of the residual (p without the
    rejected draft)."""
    k = len(drafts)
    for i in range(k):
        qx = 1.0 if q is None else float(q[i, drafts[i]])
        if float(torch.rand(1)) * qx >= float(p[i, drafts[i]]):
            return i, verify_module._draw(p[i], None)
    return k, verify_module._draw(p[k], None)


@pytest.mark.slow  # thousands of samples per proposer: 10 to 20 s each on 2 busy cores
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampling_distribution_unchanged(small_vocab_dirs, proposer, monkeypatch):
    target, draft = small_vocab_dirs
    marginals = exact_marginals(target, PROMPT, max(CHECKED) + 1)
    # one-token matches too (the PROMPT's design), so that lookup proposes at every position
    options = {"speculative": "ngram" if proposer == "ngram" else f"draft:{draft}",
               "num_speculative_tokens": 3, "ngram_min": 1}
    samples, stats = sample(target, **options)
    assert stats["total_spec_accepted_tokens"] > 300  # acceptance and rejection both ran many times
    assert stats["total_spec_draft_tokens"] - stats["total_spec_accepted_tokens"] > 300
    assert max_excess(samples, marginals) < 1.0
    # The plain sampler passes the same test: it measures the method, not the noise ...
    assert max_excess(sample(target)[0], marginals) < 1.0
    # ... and broken acceptance rules fail it.
    rule = "_sample_and_match" if proposer == "ngram" else "_rejection_sample"
    for broken in (accept_all, resample_from_p):
        monkeypatch.setattr(verify_module, rule, broken)
        assert max_excess(sample(target, **options)[0], marginals) > 1.0, broken.__name__
