"""Automatic prefix caching on the engine: hits skip compute, change no output, survive eviction."""
from __future__ import annotations

import random

import pytest

from engine.core import EngineCore
from shared.config import build_config
from shared.protocol import RequestOutput
from shared.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_1k_dir(tmp_path_factory, make_tiny_checkpoint):
    from transformers import LlamaConfig, LlamaForCausalLM

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-1k"), LlamaConfig, LlamaForCausalLM,
                                max_position_embeddings=1024)


def run(core: EngineCore, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list]:
    """-> request id -> [tokens, num_cached_tokens]"""
    out: dict[str, list] = {}
    for rid, prompt, params in reqs:
        core.add(rid, prompt, params)
        out[rid] = [[], 0]
    while core.has_work():
        for o in core.step():
            assert isinstance(o, RequestOutput), o  # an Error here fails the test
            out[o.request_id][0] += o.new_token_ids
            out[o.request_id][1] = o.num_cached_tokens
    return out


def test_second_request_with_same_512_token_prefix_computes_only_its_suffix(tiny_1k_dir):
    rng = random.Random(0)
    prefix = [rng.randrange(3, 512) for _ in range(512)]
    a, b = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]
    outs = {}
    for caching in (True, False):
        core = EngineCore(build_config(str(tiny_1k_dir), num_blocks=128, block_size=16,
                                       max_num_batched_tokens=1024, enable_prefix_caching=caching))
        first = run(core, [("a", a, GREEDY)])
        before = core.stats()["total_prefill_tokens"]
        second = run(core, [("b", b, GREEDY)])
        outs[caching] = (first, second, core.stats()["total_prefill_tokens"] - before)
    (a_on, b_on, b_prefill_on), (a_off, b_off, _) = outs[True], outs[False]
    assert a_on["a"][0] == a_off["a"][0] and b_on["b"][0] == b_off["b"][0]
    assert b_on["b"][1] == 512 and b_off["b"][1] == 0 and a_on["a"][1] == 0
    assert b_prefill_on == 5  # b's prefill computed its 5 suffix tokens only


def test_eviction_under_memory_pressure_keeps_outputs_and_frees_everything(tiny_llama_dir):
    rng = random.Random(1)
    systems = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 70))] for _ in range(4)]
    reqs = []
    for i in range(40):
        prompt = systems[i % 4] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))]
        params = (SamplingParams(temperature=0, max_tokens=rng.randint(2, 16), ignore_eos=True)
                  if i % 3 else SamplingParams(temperature=0.8, seed=i,
                                               max_tokens=rng.randint(2, 16), ignore_eos=True))
        reqs.append((f"r{i}", prompt, params))
    ref = run(EngineCore(build_config(str(tiny_llama_dir), num_blocks=512, block_size=8,
                                      enable_prefix_caching=False)), reqs)
    for cpu_blocks in (0, 64):
        core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=40, block_size=8,
                                       num_cpu_blocks=cpu_blocks, max_num_seqs=8))
        got = run(core, reqs)
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
        stats = core.stats()
        assert stats["total_prefix_hits_tokens"] > 0
        assert sum(v[1] for v in got.values()) == stats["total_prefix_hits_tokens"]
        if cpu_blocks:
            assert stats["total_evicted_to_cpu"] > 0
        bm = core.block_manager
        assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}
        bm.begin_step()
        assert bm.cpu.num_free == bm.cpu.num_blocks


def test_a_prefix_evicted_to_the_cpu_tier_is_swapped_back_in_not_recomputed(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=12, block_size=8,
                                   num_cpu_blocks=32))
    prompt = list(range(3, 60))  # 57 tokens: 7 full blocks
    first = run(core, [("a", prompt, GREEDY)])
    run(core, [("flood", list(range(100, 180)), SamplingParams(temperature=0, max_tokens=4,
                                                               ignore_eos=True))])
    assert core.block_manager.stats["evicted_to_cpu"] >= 7
    before = core.stats()["total_prefill_tokens"]
    again = run(core, [("a2", prompt, GREEDY)])
    assert again["a2"] == [first["a"][0], 56]
    assert core.block_manager.stats["prefix_cpu_hits"] > 0
    assert core.stats()["total_prefill_tokens"] - before == 1  # only its last prompt token computed


def test_reset_prefix_cache(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=32, block_size=8))
    prompt = list(range(3, 40))
    run(core, [("a", prompt, GREEDY)])
    assert run(core, [("b", prompt, GREEDY)])["b"][1] == 32
    core.reset_prefix_cache()
    assert run(core, [("c", prompt, GREEDY)])["c"][1] == 0


def test_no_prefix_caching_flag():
    import argparse

    from shared.engine_args import add_engine_args, config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args([])).cache.enable_prefix_caching is True
    off = config_from_args(p.parse_args(["--no-prefix-caching"]))
    assert off.cache.enable_prefix_caching is False
