"""The PyTorch backend (the CPU path, and the Triton kernels' oracle) against attention written out
by hand: softmax(q k^T * scale + causal mask) v per sequence, with K/V read position by position
from the block table. Batches mix every path: decodes, short queries over a context (speculative
verification), prompts without context and long chunks over a context."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.torch_backend import TorchBackend
from kernels.torch_plan import MAX_BUCKETS, SHORT_QUERY, SPLIT_COST_BLOCKS, SPLIT_RATIO, buckets
from tests.kernels.paged_batch import random_batch


@pytest.fixture(params=[False, True], ids=["torch", "native"])
def backend(request: pytest.FixtureRequest) -> TorchBackend:
    b = TorchBackend("cpu", native=request.param)
    assert b.native == request.param, "the native CPU kernel did not build (kernels/cpu)"
    return b


def naive_attention(batch, k_cache, v_cache, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """k_cache / v_cache: after the new tokens were stored. window: a query at p sees keys p -
    window + 1 .. p; softcap: scores s -> softcap * tanh(s / softcap) before the mask (Gemma 2). ->
    [T, H, D] in float64."""
    lay = batch.layout
    bs, h = lay.block_size, batch.q.shape[1]
    group = h // k_cache.shape[2]
    out, row = [], 0
    for q_len, ctx, table in zip(lay.query_lens, lay.context_lens, lay.block_tables):
        L = ctx + q_len
        # [L, Hkv, D]
        keys = torch.stack([k_cache[table[p // bs], p % bs] for p in range(L)]).double()
        vals = torch.stack([v_cache[table[p // bs], p % bs] for p in range(L)]).double()
        # [L, H, D]
        keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
        q = batch.q[row:row + q_len].double()  # [q, H, D]
        scores = torch.einsum("qhd,lhd->hql", q, keys) * batch.scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        visible = torch.arange(L)[None, :] <= torch.arange(ctx, L)[:, None]  # [q, L]
        if window is not None:
            visible &= torch.arange(L)[None, :] > torch.arange(ctx, L)[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hql,lhd->qhd", scores.softmax(-1), vals))
        row += q_len
    return torch.cat(out)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_equals_attention_by_hand(group, block_size, backend):
    query_lens = [1, 5, 1, 3, SHORT_QUERY, 7, 40, 2, 1]
    context_lens = [9, 30, 0, 13, 20, 0, 25, 1, 61]
    batch = random_batch(query_lens, context_lens, block_size=block_size, num_kv_heads=2,
                         group=group, head_dim=16, seed=block_size + group)
    k_cache, v_cache = batch.clean_caches()
    out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, backend.plan(batch.layout),
                          batch.scale)
    stored_k, stored_v = batch.stored_caches()
    torch.testing.assert_close(k_cache, torch.nan_to_num(stored_k, nan=0.0))
    want = naive_attention(batch, k_cache, v_cache)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(6, None), (None, 3.0), (13, 2.5), (1000, None)])
def test_sliding_window_and_soft_capped_scores(window, softcap, backend):
    """Gemma 2/3, Mistral, Phi-3: every path (decodes, short queries, prompt chunks, long contexts
    over several native partitions) sees only the window's keys and caps its scores."""
    query_lens = [1, 5, 1, 3, SHORT_QUERY, 7, 40, 1]
    context_lens = [9, 30, 0, 13, 20, 0, 25, 600]
    batch = random_batch(query_lens, context_lens, block_size=8, num_kv_heads=2, group=3,
                         head_dim=16, seed=11)
    k_cache, v_cache = batch.clean_caches()
    out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, backend.plan(batch.layout),
                          batch.scale, window, softcap)
    want = naive_attention(batch, k_cache, v_cache, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_bfloat16_batch_close_to_attention_by_hand(backend):
    """--dtype bfloat16 on a CPU: the cache, gathers, workspace and SDPA all in bfloat16."""
    query_lens, context_lens = [1, 1, 4, 1, 9, 30], [3, 70, 12, 0, 40, 0]
    batch = random_batch(query_lens, context_lens, block_size=8, num_kv_heads=2, group=2,
                         head_dim=32, dtype=torch.bfloat16, seed=3)
    k_cache, v_cache = batch.clean_caches()
    out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, backend.plan(batch.layout),
                          batch.scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(batch, k_cache, v_cache), atol=2e-2,
                               rtol=2e-2)


def test_bfloat16_cache_under_float32_queries(backend):
    """--kv-cache-dtype bfloat16 with a float32 model: new K/V are rounded into the cache, every
    path reads them from it, and the output is float32, close to exact attention over the rounded
    K/V."""
    query_lens, context_lens = [1, 1, 4, 1, 9, 30, 1], [3, 70, 12, 0, 40, 0, 200]
    batch = random_batch(query_lens, context_lens, block_size=8, num_kv_heads=2, group=3,
                         head_dim=32, seed=5)
    k_cache, v_cache = (c.to(torch.bfloat16) for c in batch.clean_caches())
    out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, backend.plan(batch.layout),
                          batch.scale)
    assert out.dtype == torch.float32 and k_cache.dtype == torch.bfloat16
    stored_k, _ = batch.stored_caches()
    torch.testing.assert_close(k_cache, torch.nan_to_num(stored_k, nan=0.0).to(torch.bfloat16),
                               atol=0, rtol=0)
    want = naive_attention(batch, k_cache, v_cache)  # exact, over the K/V the cache holds
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    # Decodes and short queries attend in bfloat16 (in float32 from the bfloat16 cache, natively);
    # prompt chunks upcast and stay float32-exact.
    prompt_rows = slice(sum(query_lens[:5]), sum(query_lens[:6]))
    torch.testing.assert_close(out[prompt_rows].double(), want[prompt_rows], atol=1e-5, rtol=1e-5)


# several native partitions
@pytest.mark.parametrize("query_lens,context_lens",
                         [([1, 1, 1], [5, 17, 2]), ([4, 2], [8, 30]), ([3], [0]),
                          ([1, 3, 1], [700, 510, 255])])
def test_single_path_batches(query_lens, context_lens, backend):
    """All decodes (the fast path), all short queries, one prompt alone, long contexts that the
    native kernel splits into partitions of TorchBackend.NATIVE_PART_TOKENS and merges."""
    batch = random_batch(query_lens, context_lens, block_size=8, num_kv_heads=2, group=2,
                         head_dim=8, seed=1)
    k_cache, v_cache = batch.clean_caches()
    out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, backend.plan(batch.layout),
                          batch.scale)
    torch.testing.assert_close(out.double(), naive_attention(batch, k_cache, v_cache), atol=1e-5,
                               rtol=1e-5)


def test_spread_contexts_split_into_buckets_and_match_attention_by_hand():
    """Decodes and short queries over contexts from 1 to 300 tokens run as several padded calls; the
    workspace the gathers share is reused across calls, layers and steps without leaking between
    them."""
    context_lens = [1, 300, 7, 150, 33, 290, 2, 80, 64, 200, 5, 120]
    query_lens = [1] * 8 + [3, 4, 2, 5]
    batch = random_batch(query_lens, context_lens, block_size=4, num_kv_heads=2, group=3,
                         head_dim=16, seed=7)
    k_cache, v_cache = batch.clean_caches()
    backend = TorchBackend("cpu")
    meta = backend.plan(batch.layout)
    assert len(meta.batched) > 2  # the decodes alone span 1..75 blocks
    want = None
    for _ in range(2):  # the second pass runs on a workspace the first one filled
        out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, meta, batch.scale)
        want = naive_attention(batch, k_cache, v_cache) if want is None else want
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_buckets_partition_the_batch_and_only_split_when_padding_costs_more_than_a_call():
    assert buckets([5, 5, 5, 5]) == [[0, 1, 2, 3]]
    # 4 short sequences padded to 40 blocks would read 4 * 38 padded blocks: worth a second call.
    assert buckets([2, 40, 2, 2, 2]) == [[1], [0, 2, 3, 4]]
    # One sequence one block shorter saves less than a call costs.
    assert buckets([10, 9]) == [[0, 1]]
    spread = list(range(1, 200))
    groups = buckets(spread)
    assert len(groups) == MAX_BUCKETS
    assert sorted(i for g in groups for i in g) == list(range(len(spread)))
    for g in groups:
        assert g == sorted(g)
    # Buckets are runs of lengths, longest first: none pads a sequence up to another bucket's
    # lengths.
    for longer, shorter in zip(groups, groups[1:]):
        assert min(spread[i] for i in longer) >= max(spread[i] for i in shorter)
    # While calls are left, no sequence is padded by more than 1 / SPLIT_RATIO.
    lengths = list(range(10, 60))
    groups = buckets(lengths)
    assert len(groups) < MAX_BUCKETS
    for g in groups:
        assert min(lengths[i] for i in g) > SPLIT_RATIO * max(lengths[i] for i in g)
    # Splitting right at the cost: padding 1 sequence by SPLIT_COST_BLOCKS blocks is worth one call.
    assert len(buckets([SPLIT_COST_BLOCKS + 1, 1])) == 2
    assert len(buckets([SPLIT_COST_BLOCKS, 1])) == 1


def test_native_kernel_takes_every_batch_of_short_queries():
    """Large batches too: the kernel beats gather + SDPA at every batch and context measured, in
    bfloat16 and float32 (python bench/cpu_attention.py --native), so no limit switches it off
    (issue #25, lever 1). The old limit stays reachable only by asking for it (the bench's
    baseline)."""
    backend = TorchBackend("cpu", native=True)
    large = random_batch([1] * 32 + [4], [408] * 32 + [900], block_size=16, num_kv_heads=3, group=3,
                         head_dim=8, seed=2)
    meta = backend.plan(large.layout)
    assert meta.native is not None and not meta.batched and meta.native.covers_all
    assert sorted(meta.native.q_len.tolist()) == [1] * 32 + [4]
    k_cache, v_cache = large.clean_caches()
    out = backend.forward(large.q, large.k, large.v, k_cache, v_cache, meta, large.scale)
    torch.testing.assert_close(out.double(), naive_attention(large, k_cache, v_cache), atol=1e-5,
                               rtol=1e-5)
    limited = TorchBackend("cpu", native=True, native_max_context=2048).plan(large.layout)
    assert limited.native is None and limited.batched


def test_pure_torch_backend_needs_no_native_library() -> None:
    """The torch backend in bfloat16 (the reference, and the CPU-side backend on a CUDA machine)
    starts in a process that never loaded the native kernels: it asked their library which paths it
    had and failed."""
    code = ("import torch; from kernels import get_backend; b = get_backend('torch', 'cpu', "
            "torch.bfloat16); assert not b.native and not b.native_prompts")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "CONVEYOR_NATIVE_KERNELS": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
