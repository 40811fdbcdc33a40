"""Prompt logprobs (scoring) equal transformers' log-softmax of the same positions,
however the prompt is computed: whole, in chunks, past a cached prefix, or preempted by
swap and by recompute."""
from __future__ import annotations

import random

import pytest
import torch

from engine.core import EngineCore
from engine.observe.trace import Tracer
from shared.config import build_config
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams
from tests.conftest import request_outputs
from tests.reference import hf_folder_model
from tests.traced import prefill_chunks

K = 5
TOL = 1e-4


def small_config(folder: str, **options: object):
    """A KV pool of 32 MiB (the default 2 GiB, times every core a test builds, is too much
    beside others)."""
    if "num_blocks" not in options:
        options["kv_cache_memory"] = "32MiB"
    return build_config(folder, **options)


def reference(folder, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log_softmax over the vocabulary at every position of each prompt:
    [P, V] each."""
    model = hf_folder_model(folder)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1)
                for p in prompts]


def run(core: EngineCore, prompts: list[list[int]],
        params: list[SamplingParams]) -> dict[str, list]:
    """-> request id -> (prompt logprobs from the wire, output tokens, num_cached_tokens)."""
    out: dict[str, list] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add(f"r{i}", prompt, p)
        out[f"r{i}"] = [None, [], 0]
    sent: set[tuple[str, int]] = set()
    while core.has_work():
        for o in request_outputs(core.step()):
            rec = out[o.request_id]
            if o.prompt_logprobs is not None:  # on each choice's first row, once
                assert (o.request_id, o.index) not in sent
                assert rec[0] is None or rec[0] == o.prompt_logprobs
                sent.add((o.request_id, o.index))
                rec[0] = o.prompt_logprobs
            rec[1] += o.new_token_ids
            rec[2] = o.num_cached_tokens
    return out


def assert_matches(got: list, prompt: list[int], ref: torch.Tensor, k: int = K) -> None:
    """got: the wire's list (None first); ref: [P, V] log_softmax, row p predicting token p + 1."""
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        lp, rank, top = got[j]
        row = ref[j - 1]
        assert abs(lp - row[prompt[j]].item()) < TOL
        assert rank == int((row > row[prompt[j]]).sum()) + 1
        vals, ids = row.topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert max((abs(v - r) for (_, v), r in zip(top, vals.tolist())), default=0.0) < TOL


def prompts_of(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_whole_prefill_equals_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    # a one-token prompt has nothing to score but its None
    prompts = prompts_of(0, 4, 2, 40) + [[7]]
    params = [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K)] * len(prompts)
    core = EngineCore(small_config(str(folder)))
    out = run(core, prompts, params)
    for i, ref in enumerate(reference(folder, prompts)):
        assert_matches(out[f"r{i}"][0], prompts[i], ref)
    assert len(out["r4"][0]) == 1


def test_chunked_prefill_and_other_requests_in_the_batch(tiny_llama_dir):
    """Chunks of 16 tokens; requests with and without prompt logprobs (k = 0 and 20)
    share the steps."""
    prompts = prompts_of(1, 6, 30, 90)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                             prompt_logprobs=[K, None, 0, 20][i % 4]) for i in range(len(prompts))]
    core = EngineCore(small_config(str(tiny_llama_dir), max_num_batched_tokens=16,
                                   long_prefill_threshold=16))
    tracer = Tracer()
    core.set_tracer(tracer)
    out = run(core, prompts, params)
    plain = run(EngineCore(small_config(str(tiny_llama_dir))), prompts,
                [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * len(prompts))
    # prompts went in chunks
    assert any(len(chunks) > 1 for chunks in prefill_chunks(tracer).values())
    for i, ref in enumerate(reference(tiny_llama_dir, prompts)):
        rid = f"r{i}"
        assert out[rid][1] == plain[rid][1]  # scoring changes no generated token
        k = params[i].prompt_logprobs
        if k is None:
            assert out[rid][0] is None
        else:
            assert_matches(out[rid][0], prompts[i], ref, k)


def test_cached_prefix_is_computed_again_for_scoring(tiny_llama_dir):
    rng = random.Random(2)
    prefix = [rng.randrange(3, 512) for _ in range(64)]
    prompt = prefix + [11, 12, 13]
    core = EngineCore(small_config(str(tiny_llama_dir), block_size=16, enable_prefix_caching=True))
    warm = run(core, [prefix + [21, 22]], [SamplingParams(temperature=0, max_tokens=2)])
    scored = run(core, [prompt], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)])
    again = run(core, [prompt], [SamplingParams(temperature=0, max_tokens=2)])
    # the cache still serves others
    assert warm["r0"][2] == 0 and scored["r0"][2] == 0 and again["r0"][2] == 64
    assert scored["r0"][1] == again["r0"][1]
    assert_matches(scored["r0"][0], prompt, reference(tiny_llama_dir, [prompt])[0])


@pytest.mark.parametrize("mode,cpu_blocks", [("swap", 400), ("recompute", 0)])
def test_preempted_prefills_keep_the_numbers(tiny_llama_dir, mode, cpu_blocks):
    """A pool of about a tenth of the tokens, prompts cut in chunks: requests are preempted
    mid-prompt and after it; every prompt logprob is still transformers' and is sent
    exactly once."""
    prompts = prompts_of(3, 24, 20, 70)
    params = [SamplingParams(temperature=0, max_tokens=random.Random(i).randint(4, 24),
                             ignore_eos=True, prompt_logprobs=K if i % 3 else None)
              for i in range(len(prompts))]
    total = sum(len(p) + s.max_tokens for p, s in zip(prompts, params))
    core = EngineCore(small_config(str(tiny_llama_dir), block_size=8, num_blocks=total // 10 // 8,
                                   num_cpu_blocks=cpu_blocks, preemption_mode=mode,
                                   max_num_batched_tokens=48, long_prefill_threshold=24,
                                   max_num_seqs=64))
    out = run(core, prompts, params)
    stats = core.stats()
    assert stats[f"num_preemptions_{mode}"] > 0
    expected = run(EngineCore(small_config(str(tiny_llama_dir))), prompts, params)
    for i, ref in enumerate(reference(tiny_llama_dir, prompts)):
        rid = f"r{i}"
        assert out[rid][1] == expected[rid][1]
        if params[i].prompt_logprobs is None:
            assert out[rid][0] is None
        else:
            # (bits differ with the batch's shape only)
            assert_matches(out[rid][0], prompts[i], ref)
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not core.requests


def test_n_greater_than_one_scores_the_prompt_once_and_sends_it_with_each_choice(tiny_llama_dir):
    prompt = prompts_of(4, 1, 30, 30)[0]
    core = EngineCore(small_config(str(tiny_llama_dir)))
    rows: list[RequestOutput] = []
    core.add("r0", prompt, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=3,
                                          prompt_logprobs=2))
    while core.has_work():
        rows += [o for o in request_outputs(core.step()) if o.prompt_logprobs is not None]
    # each choice's first row carries the same list
    assert sorted(o.index for o in rows) == [0, 1, 2]
    first = rows[0].prompt_logprobs
    assert first is not None and all(o.prompt_logprobs == first for o in rows)
    assert_matches(first, prompt, reference(tiny_llama_dir, [prompt])[0], k=2)
