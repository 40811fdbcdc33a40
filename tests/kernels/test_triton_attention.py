"""Triton attention (decode, varlen prefill over a cached prefix, and the backend that strings them
together) against the PyTorch backend, under TRITON_INTERPRET=1 in a worker process.

Each test body is a module-level _case_* function that run_isolated executes in the worker; inputs
are fresh random batches with scrambled block tables and a NaN-poisoned cache (paged_batch.py),
outputs are NaN-filled before the run so an element no kernel writes fails the comparison.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from kernels.torch_backend import TorchBackend
from tests.kernels.paged_batch import PagedBatch, random_batch, rel_err
from tests.kernels.triton_worker import run_isolated

SHAPES = list(itertools.product([64, 128], [1, 4, 8], [16, 32]))  # head_dim, GQA ratio, block_size
SHAPE_IDS = [f"d{d}-g{g}-bs{bs}" for d, g, bs in SHAPES]


def first_fast(cases: list[tuple]) -> list:
    """A sweep under the Triton interpreter takes seconds a case: its first case runs in make check,
    the rest are marked slow (make test runs them all)."""
    return [case if i == 0 else pytest.param(*case, marks=pytest.mark.slow)
            for i, case in enumerate(cases)]
FP32_TOL = 1e-3


def _oracle(batch) -> torch.Tensor:
    """TorchBackend on the same layout, through its public methods, on the un-poisoned caches."""
    torch_backend = TorchBackend("cpu")
    kc, vc = batch.clean_caches()
    return torch_backend.forward(batch.q, batch.k, batch.v, kc, vc,
                                 torch_backend.plan(batch.layout), batch.scale)


def _case_decode_kernel(head_dim: int, group: int, block_size: int) -> None:
    from kernels.triton import decode_attention, decode_block_n

    bs = block_size
    # Decode lengths include the new token: 1 (nothing cached), a block exactly, one past a
    # block boundary, and a few blocks with a ragged tail. Prefill rows sit between the decode
    # rows; no decode kernel may write them.
    q_lens = [1, 1, 2, 1, 1, 1]
    ctx = [0, bs - 1, 5, bs, 3 * bs + 4, 150]
    batch = random_batch(q_lens, ctx, block_size=bs, num_kv_heads=2, group=group, head_dim=head_dim,
                         seed=head_dim + group + bs)
    ref = _oracle(batch)
    kc, vc = batch.stored_caches()
    dec = [i for i, n in enumerate(q_lens) if n == 1]
    rows = torch.tensor(q_lens).cumsum(0)[dec] - 1
    seq_lens = [ctx[i] + 1 for i in dec]
    width = max(len(batch.layout.block_tables[i]) for i in dec)
    tables = torch.zeros(len(dec), width, dtype=torch.int32)
    for r, i in enumerate(dec):
        tables[r, : len(batch.layout.block_tables[i])] = torch.tensor(batch.layout.block_tables[i])
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    args = (batch.q, kc, vc, rows.to(torch.int32), seq_lens_t, tables, batch.scale, max(seq_lens))
    bn = decode_block_n(head_dim)
    # no split; many splits (with idle ones for short rows); a few
    for partition in (None, bn, 2 * bn):
        out = torch.full_like(batch.q, float("nan"))
        decode_attention(out, *args, partition=partition)
        err = rel_err(out[rows], ref[rows])
        assert err < FP32_TOL, f"partition={partition}: relative error {err}"
        others = torch.ones(out.shape[0], dtype=torch.bool)
        others[rows] = False
        assert torch.isnan(out[others]).all(), \
            f"partition={partition}: wrote a row that is not a decode row"


@pytest.mark.parametrize("head_dim,group,block_size", first_fast(SHAPES), ids=SHAPE_IDS)
def test_decode_kernel(head_dim: int, group: int, block_size: int) -> None:
    """Split-K decode with 1, several and many partitions, GQA, lengths across block boundaries."""
    run_isolated(_case_decode_kernel, head_dim=head_dim, group=group, block_size=block_size)


def _case_prefill_kernel(head_dim: int, group: int, block_size: int) -> None:
    from kernels.triton import prefill_attention, prefill_block_q, prefill_tiles

    bs = block_size
    # A fresh prompt crossing a block boundary, a length-1 prompt, a chunk after a cached prefix
    # that ends mid-block, a chunk whose prefix ends on a block boundary; a decode row in between.
    q_lens = [bs + 3, 1, 1, 21, 9]
    ctx = [0, 0, 7, bs + 5, 2 * bs]
    batch = random_batch(q_lens, ctx, block_size=bs, num_kv_heads=2, group=group, head_dim=head_dim,
                         seed=head_dim * group + bs)
    ref = _oracle(batch)
    kc, vc = batch.stored_caches()
    pre = [0, 1, 3, 4]  # sequence 2 is the decode row
    starts = torch.tensor([0] + q_lens).cumsum(0)
    width = max(len(batch.layout.block_tables[i]) for i in pre)
    tables = torch.zeros(len(pre), width, dtype=torch.int32)
    for r, i in enumerate(pre):
        tables[r, : len(batch.layout.block_tables[i])] = torch.tensor(batch.layout.block_tables[i])
    block_q = prefill_block_q(2 * group, 2, batch.q.dtype)
    tiles = prefill_tiles([q_lens[i] for i in pre], block_q)
    tile_seq, tile_start = (torch.tensor(x, dtype=torch.int32) for x in tiles)
    out = torch.full_like(batch.q, float("nan"))
    i32 = torch.int32
    prefill_attention(out, batch.q, kc, vc, tile_seq, tile_start, starts[pre].to(i32),
                      torch.tensor([q_lens[i] for i in pre], dtype=i32),
                      torch.tensor([ctx[i] for i in pre], dtype=i32), tables, batch.scale)
    decode_row = int(starts[2])
    mine = torch.ones(out.shape[0], dtype=torch.bool)
    mine[decode_row] = False
    err = rel_err(out[mine], ref[mine])
    assert err < FP32_TOL, f"relative error {err}"
    assert torch.isnan(out[decode_row]).all(), "the prefill kernel wrote the decode row"


@pytest.mark.parametrize("head_dim,group,block_size", first_fast(SHAPES), ids=SHAPE_IDS)
def test_prefill_kernel(head_dim: int, group: int, block_size: int) -> None:
    """Varlen prefill: causal within the new tokens, full over a cached prefix, GQA row packing."""
    run_isolated(_case_prefill_kernel, head_dim=head_dim, group=group, block_size=block_size)


def _case_backend(head_dim: int, group: int, block_size: int, dtype: str, split: bool,
                  seed: int) -> None:
    from kernels.triton import decode_block_n
    from kernels.triton_backend import TritonBackend

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    # A step as the chunked scheduler makes it: decodes of several lengths, a fresh prompt, a
    # chunk after a prefix-cache hit; lengths drawn fresh per seed.
    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    q_lens = [1, 1, draw(2, 3 * bs), 1, draw(2, 40)]
    ctx = [0, draw(bs, 5 * bs), 0, bs - 1, draw(1, 3 * bs)]
    batch = random_batch(q_lens, ctx, block_size=bs, num_kv_heads=2, group=group, head_dim=head_dim,
                         dtype=dt, seed=seed)
    if dt == torch.float32:
        ref = _oracle(batch)
    else:  # the oracle in fp32 on the same (bf16-rounded) inputs
        up = PagedBatch(batch.layout, batch.q.float(), batch.k.float(), batch.v.float(),
                        batch.k_cache.float(), batch.v_cache.float())
        ref = _oracle(up)
    triton_backend = TritonBackend("cpu",
                                   **(dict(min_partition=16, target_programs=64) if split else {}))
    meta = triton_backend.plan(batch.layout)
    if split:
        partition = triton_backend._decode_partition(meta.num_decodes, 2, meta.decode_max_len,
                                                     decode_block_n(head_dim))
        assert partition is not None, "the split-K path was not taken"
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    out = torch.full_like(batch.q, float("nan"))
    returned = triton_backend.forward(batch.q, batch.k, batch.v, kc, vc, meta, batch.scale, out=out)
    assert returned is out
    err = rel_err(out, ref)
    tol = FP32_TOL if dt == torch.float32 else 1e-2
    assert err < tol, f"relative error {err} (tolerance {tol})"
    want_k, want_v = batch.stored_caches()
    torch.testing.assert_close(kc, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc, want_v, rtol=0, atol=0, equal_nan=True)
    # Without a caller's buffer, and a second layer reusing the step's plan, gives the same result.
    again = triton_backend.forward(batch.q, batch.k, batch.v, kc, vc, meta, batch.scale)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


BACKEND_CASES = [
    (64, 1, 16, "float32", False),
    (64, 4, 32, "float32", True),
    (64, 8, 16, "float32", True),
    (128, 1, 32, "float32", True),
    (128, 4, 16, "float32", False),
    (128, 8, 32, "float32", True),
    (64, 4, 16, "bfloat16", True),
    (128, 8, 32, "bfloat16", False),
]


@pytest.mark.parametrize("head_dim,group,block_size,dtype,split", first_fast(BACKEND_CASES),
                         ids=[f"d{d}-g{g}-bs{b}-{t}-{'split' if s else 'nosplit'}"
                              for d, g, b, t, s in BACKEND_CASES])
def test_backend_forward_matches_torch(head_dim: int, group: int, block_size: int, dtype: str,
                                       split: bool) -> None:
    """TritonBackend and TorchBackend, same BatchLayout, public plan/forward: same output, same
    cache."""
    run_isolated(_case_backend, head_dim=head_dim, group=group, block_size=block_size, dtype=dtype,
                 split=split, seed=head_dim + 10 * group + block_size + split)


def _case_backend_edges() -> None:
    from kernels.triton_backend import TritonBackend

    for q_lens, ctx in [([1], [0]), ([1, 1, 1], [0, 0, 0]), ([5], [0]), ([1], [31]),
                        ([3, 1], [0, 64])]:
        batch = random_batch(q_lens, ctx, block_size=16, num_kv_heads=1, group=4, head_dim=64,
                             seed=len(q_lens) + sum(ctx))
        ref = _oracle(batch)
        tb = TritonBackend("cpu", min_partition=16, target_programs=64)
        out = torch.full_like(batch.q, float("nan"))
        kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
        tb.forward(batch.q, batch.k, batch.v, kc, vc, tb.plan(batch.layout), batch.scale, out=out)
        err = rel_err(out, ref)
        assert err < FP32_TOL, f"q_lens={q_lens} context_lens={ctx}: relative error {err}"


def test_backend_edge_batches() -> None:
    """Single tokens with no context, all-decode and all-prefill steps, one KV head."""
    run_isolated(_case_backend_edges)


def _case_backend_strided_qkv() -> None:
    from kernels.triton_backend import TritonBackend

    batch = random_batch([1, 9], [20, 4], block_size=16, num_kv_heads=2, group=4, head_dim=64,
                         seed=7)
    t, h, d = batch.q.shape
    # q, k, v as views of one fused projection output [T, (H + 2*Hkv) * D], as a model produces
    # them.
    qkv = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d: (h + 2) * d].view(t, 2, d)
    v = qkv[:, (h + 2) * d:].view(t, 2, d)
    assert not q.is_contiguous()
    ref = _oracle(batch)
    tb = TritonBackend("cpu")
    out = tb.forward(q, k, v, batch.k_cache.clone(), batch.v_cache.clone(), tb.plan(batch.layout),
                     batch.scale)
    assert rel_err(out, ref) < FP32_TOL


def test_backend_strided_qkv() -> None:
    """q/k/v that are views of a fused QKV output (row stride != H*D) are read through their
    strides."""
    run_isolated(_case_backend_strided_qkv)


def _case_cpu_refused() -> None:
    from kernels import get_backend

    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("triton", "cpu")
    assert type(get_backend("auto", "cpu")).__name__ == "TorchBackend"


@pytest.mark.slow  # a fresh worker without the interpreter: about a minute on 2 busy cores
def test_triton_on_cpu_without_interpreter_is_refused() -> None:
    """--attention-backend triton on a CPU machine fails at start-up with a readable reason."""
    run_isolated(_case_cpu_refused, interpret=False)
