"""Tensor parallelism with local worker processes: greedy (and seeded) float32 output equal to TP=1
token for token through chunked prefill, prefix caching, swap and recompute preemption, n > 1 and
beam search; every block free at the end, every worker still in step (it takes STOP and exits 0)."""
from __future__ import annotations

import pytest
import torch

from engine.core import EngineCore
from shared.config import build_config
from shared.sampling import SamplingParams
from tests.distributed.workload import BLOCK, assert_all_free, run, workload
from tests.engine.test_embeddings import PROMPTS, cosine, embed_all, hf_pooled

COMMON = dict(dtype="float32", num_threads=1, block_size=BLOCK, max_num_batched_tokens=32,
              max_num_seqs=16)


def tp_engine(folder, tp: int, **options) -> EngineCore:
    return EngineCore(build_config(str(folder), tensor_parallel_size=tp, **{**COMMON, **options}))


def stop(core: EngineCore) -> list[int]:
    """Closes the engine; -> each worker's exit code (0: it took STOP, so it had followed
    every step)."""
    core.close()
    return [w.proc.returncode for w in core.runner.workers]  # type: ignore[attr-defined]


def assert_tp2_equals_tp1(folder, reqs, tp1: dict, tp2: dict) -> dict:
    """Runs reqs on TP=1 (the reference) and on TP=2 with these options each; asserts the same
    tokens, every block free, and the worker ended by STOP. -> the TP=2 engine's stats."""
    reference = run(tp_engine(folder, 1, **tp1), reqs)
    core = tp_engine(folder, 2, **tp2)
    try:
        out = run(core, reqs)
        stats = core.stats()
    finally:
        codes = stop(core)
    assert out == reference
    assert_all_free(core)
    assert codes == [0]
    return stats


def stop_ray_engine(core: EngineCore) -> None:
    """Closes an engine whose workers are Ray actors; asserts each ended by STOP (returned 0)."""
    import ray

    core.close()
    workers = core.runner.workers  # type: ignore[attr-defined]
    assert [ray.get(w.done, timeout=30) for w in workers] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tp2_equals_tp1_under_preemption(checkpoint, request):
    stats = assert_tp2_equals_tp1(request.getfixturevalue(checkpoint), workload(),
                                  dict(num_blocks=1024, num_cpu_blocks=0),
                                  dict(num_blocks=20, num_cpu_blocks=6, preemption_mode="auto"))
    assert stats["num_preemptions_swap"] > 0 and stats["num_preemptions_recompute"] > 0
    assert stats["total_prefix_hits_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["last", "mean"])
def test_tp2_embeddings_equal_tp1_and_transformers(tiny_llama_dir, mode):
    """Pooling reads the final hidden states, whole on every rank once the layers' all-reduces are
    done: rank 0 pools them while the workers run the step's collectives with it. A 150-token input
    in 32-token chunks (mean sums them), decodes in the same steps; the vectors are TP=1's and
    transformers' last_hidden_state pooled."""
    options = dict(num_blocks=64, pooling=mode, long_prefill_threshold=32)
    generate = {"g1": [9, 8, 7], "g2": list(range(20, 60))}
    reference = embed_all(tp_engine(tiny_llama_dir, 1, **options), PROMPTS, generate)
    core = tp_engine(tiny_llama_dir, 2, **options)
    try:
        got = embed_all(core, PROMPTS, generate)
    finally:
        codes = stop(core)
    for rid, ids in PROMPTS.items():
        assert torch.allclose(torch.tensor(got[rid]), torch.tensor(reference[rid]), atol=1e-5), rid
        assert cosine(got[rid], hf_pooled(tiny_llama_dir, ids, mode)) > 0.9999, rid
    assert_all_free(core)
    assert codes == [0]


def test_heads_that_do_not_divide_are_refused(tiny_llama_dir):
    refusal = r"tensor_parallel_size 3 does not divide .*heads.*sizes that do: 1, 2"
    with pytest.raises(ValueError, match=refusal):
        tp_engine(tiny_llama_dir, 3)


def test_experts_are_refused(tmp_path):
    """shard.py does not split experts: refused by name before any worker starts, rather than
    loaded wrong."""
    import transformers as T

    from tests.conftest import save_tiny

    folder = save_tiny(tmp_path, T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, head_dim=16,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    refusal = r"Qwen3MoeForCausalLM needs experts, which tensor parallelism does not"
    with pytest.raises(ValueError, match=refusal):
        tp_engine(folder, 2)


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(smollm2_source):
    """SmolLM2 has 9 query and 3 K/V heads: 3 is its only split. Short prompts, few tokens. The
    GGUF's Q4 groups are not sliced, so --quantization auto (the default) serves it dequantized at
    TP=3 on every rank: equal to TP=1 dequantized, whatever TP=1's auto would pick on this CPU."""
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_source)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):\n    ")]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reqs = [(f"s{i}", p, params) for i, p in enumerate(prompts)]
    reference = run(tp_engine(smollm2_source.name, 1, num_blocks=64, num_cpu_blocks=0,
                              max_num_batched_tokens=8, quantization="none"), reqs)
    core = tp_engine(smollm2_source.name, 3, num_blocks=64, num_cpu_blocks=0,
                     max_num_batched_tokens=8)
    try:
        out = run(core, reqs)
    finally:
        codes = stop(core)
    assert out == reference
    assert_all_free(core)
    assert codes == [0, 0]


def test_kv_budgets_are_totals_over_the_ranks(tiny_llama_dir, caplog):
    """--kv-cache-memory and --swap-space under TP=2 take what they say in all (each rank half), and
    hold the blocks, so the tokens, of one engine with the same budgets; the log says the totals."""
    budget = dict(kv_cache_memory="4MiB", swap_space="2MiB")
    one = tp_engine(tiny_llama_dir, 1, **budget).block_manager
    with caplog.at_level("INFO", logger="conveyor.tp"):
        two = tp_engine(tiny_llama_dir, 2, **budget)
    try:
        kv = two.runner.rank0.kv  # type: ignore[attr-defined]
        bm = two.block_manager
        assert (bm.num_blocks, bm.cpu.num_blocks) == (one.num_blocks, one.cpu.num_blocks)
        assert one.num_blocks > 1 and one.cpu.num_blocks > 1
        block = 2 * kv.device.nbytes / one.num_blocks  # one block's bytes over both ranks
        assert 4 * 2**20 - 2 * kv.device.nbytes < block  # the budget, less than a block short
        assert 2 * kv.device.nbytes <= 4 * 2**20 and 2 * kv.cpu.nbytes <= 2 * 2**20
    finally:
        codes = stop(two)
    assert codes == [0]
    assert f"KV pools over all ranks: {one.num_blocks} blocks" in caplog.text


def test_per_rank_budgets_split_totals_but_not_a_gpus_own_fraction(monkeypatch):
    """Bytes and host-memory fractions are shared by the ranks (each gets 1/N); a fraction of a
    GPU's free memory is each rank's own GPU's, as for one engine on one GPU."""
    import torch

    from engine.distributed import rank
    from shared.config import CacheConfig

    def free(device: torch.device) -> int:
        return 1000 if device.type == "cuda" else 8000

    monkeypatch.setattr(rank, "available_memory", free)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    split = rank.per_rank_cache(CacheConfig(kv_cache_memory="4000", swap_space="0.5"), 4, cpu)
    assert (split.kv_cache_memory, split.swap_space) == ("1000", "1000")
    host = rank.per_rank_cache(CacheConfig(kv_cache_memory="0.5", swap_space="0"), 2, cpu)
    assert (host.kv_cache_memory, host.swap_space) == ("2000", "0")
    gpu = rank.per_rank_cache(CacheConfig(kv_cache_memory="0.5", swap_space="800"), 2, cuda)
    assert (gpu.kv_cache_memory, gpu.swap_space) == ("500", "400")
