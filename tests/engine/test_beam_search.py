"""Beam search against transformers' generate(num_beams=..., do_sample=False), same length_penalty
and early_stopping; and the blocks of dropped beams come back."""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationMixin

from engine.core import EngineCore
from shared.config import build_config
from shared.sampling import SamplingParams
from tests.conftest import request_outputs
from tests.reference import hf_folder_model, transformers_gguf_model

PAD = 1  # transformers fills with `pad_token_id or eos`: 0 would read as "use eos"


def hf_beams(model, prompt: list[int], params: SamplingParams, eos: int | None) -> list[list[int]]:
    model.generation_config.eos_token_id = eos
    x = torch.tensor([prompt])
    y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=params.max_tokens,
                       do_sample=False, num_beams=params.beam_width, num_return_sequences=params.n,
                       pad_token_id=PAD, length_penalty=params.length_penalty,
                       early_stopping=params.early_stopping)
    return [row[len(prompt):].tolist() for row in y]


def engine_beams(core: EngineCore, prompts: list[list[int]],
                 params: SamplingParams) -> list[list[list[int]]]:
    """All prompts in one batch. -> per prompt, its n sequences in order."""
    out: dict[tuple[str, int], list[int]] = {}
    for i, p in enumerate(prompts):
        core.add(f"r{i}", p, params)
    while core.has_work():
        for o in request_outputs(core.step()):
            out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    return [[out[(f"r{i}", k)] for k in range(params.n)] for i in range(len(prompts))]


def assert_same(ours: list[list[int]], ref: list[list[int]]) -> None:
    """transformers pads shorter beams with PAD; ours are exactly as long as generated."""
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert b[:len(a)] == a and all(t == PAD for t in b[len(a):]), (ours, ref)


PROMPTS = [[5, 17, 33, 90, 121], list(range(40, 75)),
           [300, 301, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.mark.parametrize("width,n,length_penalty,early_stopping,stop", [
    (4, 2, 1.0, False, False), (3, 3, 0.0, True, True), (4, 1, 2.0, "never", True),
    (2, 2, -1.0, False, True),
])
def test_beam_search_equals_transformers(tiny_llama_dir, width, n, length_penalty, early_stopping,
                                         stop):
    model = hf_folder_model(tiny_llama_dir)
    # a causal LM: transformers 5 mixes generate in per class
    assert isinstance(model, GenerationMixin)
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=128, block_size=8))
    stop_token = None
    if stop:  # a stop token that really comes up: the third greedy token of the first prompt
        with torch.no_grad():
            g = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=3, do_sample=False,
                               pad_token_id=PAD)
        stop_token = int(g[0, -1])
    params = SamplingParams(max_tokens=12, use_beam_search=True, beam_width=width, n=n,
                            ignore_eos=True, length_penalty=length_penalty,
                            early_stopping=early_stopping,
                            stop_token_ids=() if stop_token is None else (stop_token,))
    ours = engine_beams(core, PROMPTS, params)
    for prompt, got in zip(PROMPTS, ours):
        assert_same(got, hf_beams(model, prompt, params, stop_token))
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}


def test_beams_share_blocks_and_free_dropped_ones(tiny_llama_dir):
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=64, block_size=8,
                                   enable_prefix_caching=False))
    core.add("b", list(range(3, 40)),
             SamplingParams(max_tokens=10, use_beam_search=True, beam_width=4, ignore_eos=True))
    seen_shared = False
    while core.has_work():
        core.step()
        beams = core.scheduler.running
        if len(beams) == 4:
            counts = core.block_manager.ref_counts
            # the 37-token prompt's first 4 blocks are held once, by all four beams
            assert all(counts[b] == 4 for b in beams[0].block_table[:4])
            assert 64 - core.block_manager.num_free_blocks < 4 * 6
            seen_shared = True
    assert seen_shared and core.block_manager.num_free_blocks == 64


@pytest.mark.slow
def test_smollm2_beam_search_equals_transformers(smollm2_source):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_source.folder, gguf_file=smollm2_source.gguf_file)
    prompts = [tok.encode(t) for t in ["The capital of France is", "def add(a, b):",
                                       "Once upon a time"]]
    params = SamplingParams(max_tokens=16, use_beam_search=True, beam_width=4, n=2,
                            length_penalty=1.0)
    core = EngineCore(build_config("SmolLM2-135M-Instruct", dtype="float32", quantization="none",
                                   kv_cache_memory="256MiB"))
    ours = engine_beams(core, prompts, params)
    model = transformers_gguf_model(smollm2_source)
    for prompt, got in zip(prompts, ours):
        assert_same(got, hf_beams(model, prompt, params, list(core.eos_token_ids)[0]))


@pytest.mark.parametrize("mode,num_cpu_blocks", [("swap", 96), ("recompute", 0), ("auto", 6)])
def test_beam_search_under_kv_pressure_completes_and_equals_the_unpressured_output(
        tiny_llama_dir, mode, num_cpu_blocks):
    """Beams are preempted and resumed as a group. Before, one beam preempted alone could not
    come back while its siblings held their blocks waiting for it, and every later step was
    empty, for ever."""
    params = SamplingParams(max_tokens=12, use_beam_search=True, beam_width=4, n=2, ignore_eos=True)
    prompts = [list(range(3 + 11 * i, 38 + 11 * i)) for i in range(3)]  # 35 tokens each

    def run(core: EngineCore) -> dict[tuple[str, int], list[int]]:
        out: dict[tuple[str, int], list[int]] = {}
        for i, p in enumerate(prompts):
            core.add(f"r{i}", p, params)
        for _ in range(3000):  # a stalled scheduler would loop for ever: bound it
            if not core.has_work():
                break
            for o in request_outputs(core.step()):
                out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        assert not core.has_work(), "the engine stopped making progress"
        return out

    ref = run(EngineCore(build_config(str(tiny_llama_dir), num_blocks=256, block_size=8)))
    # 24 blocks: one request's beams fit even unshared (4 beams x 6 blocks of 47
    # tokens); three do not.
    core = EngineCore(build_config(str(tiny_llama_dir), num_blocks=24, block_size=8,
                                   num_cpu_blocks=num_cpu_blocks, preemption_mode=mode,
                                   enable_prefix_caching=False))
    assert run(core) == ref
    stats = core.stats()
    assert stats["total_stalled_steps"] == 0
    # which mode auto picks is tested in test_preemption.py; here, that it preempted
    if mode == "auto":
        assert stats["num_preemptions_swap"] + stats["num_preemptions_recompute"] > 0
    else:
        assert stats[f"num_preemptions_{mode}"] > 0
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.cpu.num_free == bm.cpu.num_blocks
    assert set(bm.ref_counts) == {0}
