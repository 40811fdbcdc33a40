"""The native CPU attention kernel (kernels/cpu), each of its code paths, against attention
written out by hand in float64 (softmax(q k^T * scale) v per sequence and head, K/V read position
by position through the block table), on scrambled block tables with NaN in every slot no
sequence owns.

Paths: portable, avx2, avx512 (the same C++ compiled for each x86 level: float32 math) and
avx512_bf16 (bfloat16 q and cache, head dim a multiple of 32: vdpbf16ps on the cache's rows). A
path this CPU cannot run is skipped, with the reason. Tolerances: float32 1e-5 (absolute and
relative), bfloat16 1e-2 (inputs and output rounded to bfloat16; every product exact in float32,
sums in float32).

Then the property issue #30 asks of attention: a token's output has the same bits whether it is a
decode row, inside a prompt chunk (chunked anywhere), or attends a prefix written earlier, in a
batch of any other sequences."""
from __future__ import annotations

import pytest
import torch

from kernels.torch_backend import TorchBackend
from tests.kernels.paged_batch import PagedBatch, random_batch

ISAS = ["portable", "avx2", "avx512", "avx512_bf16", "amx"]


@pytest.fixture(scope="module")
def runnable() -> list[str]:
    backend = TorchBackend("cpu", native=True)
    assert backend.native, "the native CPU kernel did not build (kernels/cpu)"
    return list(torch.ops.conveyor_cpu.attention_isas())


def native(isa: str, runnable: list[str], dtype: torch.dtype) -> TorchBackend:
    if isa not in runnable:
        pytest.skip(f"this CPU cannot run the {isa} path (it reports {', '.join(runnable)})")
    if isa in ("avx512_bf16", "amx") and dtype != torch.bfloat16:
        pytest.skip(f"{isa} takes bfloat16 q and cache only")
    backend = TorchBackend("cpu", native=True)
    backend.native_isa, backend.native_prompts = isa, True  # prompt chunks too, whatever the dtype
    return backend


def reference(batch: PagedBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None,
              softcap: float | None) -> torch.Tensor:
    """Exact attention in float64 over what the caches hold. -> [T, H, D]"""
    lay, h = batch.layout, batch.q.shape[1]
    nb, bs, hkv, d = k_cache.shape
    flat_k, flat_v = k_cache.reshape(nb * bs, hkv, d).double(), v_cache.reshape(nb * bs, hkv,
                                                                                d).double()
    out, row = [], 0
    for q_len, ctx, table in zip(lay.query_lens, lay.context_lens, lay.block_tables):
        pos = torch.arange(ctx + q_len)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        keys = flat_k[slots].repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        vals = flat_v[slots].repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("qhd,lhd->hql", batch.q[row:row + q_len].double(), keys) * batch.scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(ctx, ctx + q_len)[:, None]
        visible = (pos[None, :] <= qpos) & ((pos[None, :] > qpos - window) if window else True)
        out.append(torch.einsum("hql,lhd->qhd",
                                scores.masked_fill(~visible, float("-inf")).softmax(-1), vals))
        row += q_len
    return torch.cat(out)


def check(backend: TorchBackend, batch, dtype: torch.dtype, window: int | None = None,
          softcap: float | None = None) -> None:
    # poisoned: NaN wherever no sequence is
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    meta = backend.plan(batch.layout)
    assert meta.native is not None and meta.native.covers_all  # every row through the kernel
    out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, meta, batch.scale, window,
                          softcap)
    clean_k, clean_v = (torch.nan_to_num(c, nan=0.0) for c in (k_cache, v_cache))
    want = reference(batch, clean_k, clean_v, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


DTYPES = [torch.float32, torch.bfloat16]
# Contexts across block and partition (256 tokens) edges, up to 4,096 tokens of context in all.
CONTEXTS = [0, 15, 16, 17, 255, 256, 257, 1000, 4095]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group,head_dim,block_size",
                         [(1, 64, 16), (3, 64, 16), (8, 128, 16), (4, 128, 32)])
def test_decodes_equal_attention_by_hand(isa, dtype, group, head_dim, block_size, runnable):
    batch = random_batch([1] * len(CONTEXTS), CONTEXTS, block_size=block_size, num_kv_heads=2,
                         group=group, head_dim=head_dim, dtype=dtype, seed=group + head_dim)
    check(native(isa, runnable, dtype), batch, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_short_queries_and_prompt_chunks_equal_attention_by_hand(isa, dtype, runnable):
    """Speculative verification (2..16 tokens), prompts without context and chunks over a
    cached prefix."""
    query_lens, context_lens = [4, 16, 17, 40, 1, 100], [30, 0, 250, 700, 3, 0]
    batch = random_batch(query_lens, context_lens, block_size=16, num_kv_heads=2, group=3,
                         head_dim=64, dtype=dtype, seed=4)
    check(native(isa, runnable, dtype), batch, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window,softcap", [(7, None), (None, 30.0), (300, 5.0)])
def test_sliding_windows_and_soft_capping(isa, dtype, window, softcap, runnable):
    query_lens, context_lens = [1, 1, 1, 5, 33], [6, 299, 900, 40, 280]
    batch = random_batch(query_lens, context_lens, block_size=16, num_kv_heads=2, group=2,
                         head_dim=64, dtype=dtype, seed=6)
    check(native(isa, runnable, dtype), batch, dtype, window, softcap)


def one_sequence(seed: int, length: int, hkv: int, spare: int, dtype: torch.dtype
                 ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random sequence of length tokens (3 query heads per KV head, D 64) in 16-token blocks
    scattered over a cache with spare blocks more. -> (its block table, K cache, V cache, q)"""
    gen = torch.Generator().manual_seed(seed)
    bs, group, d = 16, 3, 64
    blocks = -(-length // bs) + spare
    table = torch.randperm(blocks, generator=gen)[: -(-length // bs)].tolist()
    kc, vc = (torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(length, hkv * group, d, generator=gen).to(dtype)
    return table, kc, vc, q


def attend(isa: str, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: list[int],
           pieces: list[tuple[int, int]], window: int, softcap: float) -> torch.Tensor:
    """One kernel call in which each (start, end) of pieces is a sequence whose tokens
    start..end-1 are queries over the cached positions 0..start-1 (the same blocks for all).
    -> [sum of lengths, H, D]"""
    rows = torch.cat([q[a:b] for a, b in pieces])
    out = torch.full_like(rows, float("nan"))
    starts = torch.tensor([0] + [b - a for a, b in pieces[:-1]]).cumsum(0).to(torch.int32)
    int32 = torch.int32
    torch.ops.conveyor_cpu.paged_attention(
        out, rows, kc, vc, torch.tensor([table] * len(pieces), dtype=int32), starts,
        torch.tensor([b - a for a, b in pieces], dtype=int32),
        torch.tensor([b for _, b in pieces], dtype=int32),
        q.shape[-1] ** -0.5, TorchBackend.NATIVE_PART_TOKENS, window, softcap, isa)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (100, 20.0)])
def test_a_token_gets_the_same_bits_however_its_prompt_is_split(isa, dtype, window, softcap,
                                                                runnable):
    """Issue #30: the whole prompt at once; every token as a decode row (all in one batch); the
    prompt in chunks cut at random places (some of at most 16 tokens, which take the decode-style
    tasks, some longer); and the same beside other sequences: every row's output bitwise equal."""
    native(isa, runnable, dtype)  # skips what this CPU cannot run
    length = 600
    table, kc, vc, q = one_sequence(30, length, hkv=2, spare=4, dtype=dtype)
    gen = torch.Generator().manual_seed(31)
    whole = attend(isa, q, kc, vc, table, [(0, length)], window, softcap)
    assert not whole.isnan().any()
    decodes = attend(isa, q, kc, vc, table, [(p, p + 1) for p in range(length)], window, softcap)
    assert torch.equal(decodes, whole)
    for _ in range(3):
        cuts = sorted(set(torch.randint(1, length, (6,), generator=gen).tolist()) | {0, length, 5,
                                                                                     12})
        pieces = list(zip(cuts, cuts[1:]))
        chunked = attend(isa, q, kc, vc, table, pieces, window, softcap)
        assert torch.equal(chunked, whole), pieces
        # Beside other sequences' rows (a decode, a short query, a prompt), in another order.
        others = [(40, 41), (200, 207), (0, 90)]
        mixed = attend(isa, q, kc, vc, table, others + pieces[::-1], window, softcap)
        ours = torch.cat([whole[a:b] for a, b in pieces[::-1]])
        assert torch.equal(mixed[sum(b - a for a, b in others):], ours)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_lone_decode_cut_per_kv_head_gets_its_bits_in_a_batch(isa, dtype, threads, runnable):
    """A step with few partitions (one stream, a short context) cuts each partition's task per KV
    head, and a sequence's partials merge in whichever task finishes it last; a large batch does
    neither. A decode row alone, at contexts across block and partition edges, has the bits it has
    inside a batch of 300 decode rows over the same cache, and the sliding window's rows too."""
    native(isa, runnable, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        length = 900
        table, kc, vc, q = one_sequence(25, length, hkv=3, spare=2, dtype=dtype)
        for window in (0, 100):
            batch = attend(isa, q, kc, vc, table, [(p, p + 1) for p in range(0, length, 3)], window,
                           0.0)
            for p in (0, 15, 18, 255, 258, 300, 513, 768, 897):  # rows of the batch: multiples of 3
                alone = attend(isa, q, kc, vc, table, [(p, p + 1)], window, 0.0)
                assert torch.equal(alone, batch[p // 3:p // 3 + 1]), (p, window)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group,head_dim", [(4, 64), (8, 128), (5, 96)])
def test_a_query_heads_bits_do_not_depend_on_its_place_in_its_group(isa, group, head_dim, runnable):
    """The avx512_bf16 path scores a decode token's query heads three at a time per K load (then
    two, or one): a head's scores must not depend on which heads share its loads. Rolling the heads
    inside each group moves every head to another place (alone, or second of three), and its output
    keeps its bits."""
    native(isa, runnable, torch.bfloat16)
    gen = torch.Generator().manual_seed(group)
    length, hkv, bs = 200, 2, 16
    table = torch.randperm(-(-length // bs), generator=gen).tolist()
    kc, vc = (torch.randn(len(table), bs, hkv, head_dim, generator=gen).to(torch.bfloat16)
              for _ in range(2))
    q = torch.randn(length, hkv * group, head_dim, generator=gen).to(torch.bfloat16)
    roll = torch.tensor([h * group + (g + 1) % group for h in range(hkv) for g in range(group)])
    decodes = [(p, p + 1) for p in range(0, length, 9)]
    for softcap in (0.0, 20.0):
        out = attend(isa, q, kc, vc, table, decodes, 0, softcap)
        rolled = attend(isa, q[:, roll], kc, vc, table, decodes, 0, softcap)
        assert torch.equal(rolled, out[:, roll]), softcap


# float32 runs the generic paths only: block sizes off their eight-key lanes (4; 1, 64 blocks a
# unit) take the scalar tails
UNIT_CASES = [(torch.bfloat16, 8, 3, 64, 0), (torch.bfloat16, 32, 4, 128, 0),
              (torch.bfloat16, 16, 2, 96, 70), (torch.float32, 16, 3, 64, 0),
              (torch.float32, 4, 3, 64, 0), (torch.float32, 1, 2, 64, 70),
              (torch.float32, 8, 8, 64, 0), (torch.float32, 16, 4, 80, 70)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,block_size,group,head_dim,window", UNIT_CASES)
def test_prompt_and_decode_rows_agree_across_softmax_units(isa, dtype, block_size, group, head_dim,
                                                           window, runnable):
    """A row's online softmax runs once per 64-position unit (fewer positions where a block is
    larger), and on the avx512_bf16 path spans of 8..16 tokens score with tokens as lanes while
    shorter ones score with keys as lanes: two layouts of one arithmetic. On the float32 paths a
    prompt token's query heads share K and V loads in groups of up to three (8 heads: 3 + 3 + 2),
    a decode row goes alone: the same sums. Per block size (smaller
    than 16, which pads the kernel's 16-key groups, and larger), head dim and window: the whole
    prompt against attention in float64, and pieces of 1..40 tokens cut across unit and partition
    edges, and decode rows, give the whole prompt's bits."""
    native(isa, runnable, dtype)
    gen = torch.Generator().manual_seed(block_size)
    length, hkv = 300, 2
    blocks = -(-length // block_size) + 3
    table = torch.randperm(blocks, generator=gen)[: -(-length // block_size)].tolist()
    kc, vc = (torch.randn(blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
              for _ in range(2))
    q = torch.randn(length, hkv * group, head_dim, generator=gen).to(dtype)
    whole = attend(isa, q, kc, vc, table, [(0, length)], window, 0.0)
    keys, vals = (c[table].flatten(0, 1)[:length].double().repeat_interleave(group, dim=1)
                  for c in (kc, vc))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * head_dim ** -0.5
    pos = torch.arange(length)
    visible = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window
                                                else True)
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                        vals)
    torch.testing.assert_close(whole.double(), want, atol=1e-2, rtol=1e-2)
    cuts = [0, 1, 9, 16, 63, 64, 65, 71, 120, 128, 129, 136, 150, 190, 230, 255, 256, 257, 270, 271,
            length]
    pieces = list(zip(cuts, cuts[1:]))  # 1, 7, 8, 15, 16, 17, 40 tokens, ...
    assert torch.equal(attend(isa, q, kc, vc, table, pieces, window, 0.0), whole)
    decodes = attend(isa, q, kc, vc, table, [(p, p + 1) for p in range(0, length, 7)], window, 0.0)
    assert torch.equal(decodes, whole[::7])


def test_prompt_chunks_take_the_kernel_where_its_bfloat16_path_runs(runnable, monkeypatch):
    """Prompts take the avx512_bf16 path, which served faster than SDPA (docs/kernels.md); the
    float32 paths do not. --deterministic puts prompts on the kernel wherever it runs;
    CONVEYOR_NATIVE_PROMPTS forces either way."""
    from kernels import get_backend

    def cpu(dtype: torch.dtype, deterministic: bool = False) -> TorchBackend:
        backend = get_backend("cpu", "cpu", dtype, deterministic)
        # "cpu" is the torch backend with the native kernel
        assert isinstance(backend, TorchBackend)
        return backend

    monkeypatch.delenv("CONVEYOR_NATIVE_PROMPTS", raising=False)
    monkeypatch.delenv("CONVEYOR_ATTENTION_ISA", raising=False)
    bf16, fp32 = cpu(torch.bfloat16), cpu(torch.float32)
    assert bf16.native_prompts == ("avx512_bf16" in runnable)
    assert cpu(torch.bfloat16, deterministic=True).native_prompts
    assert not fp32.native_prompts
    batch = random_batch([1, 40], [30, 20], block_size=16, num_kv_heads=1, group=2, head_dim=64,
                         seed=9)
    native = bf16.plan(batch.layout).native
    assert native is not None  # the decode row is the kernel's in any case
    assert (native.covers_all is True) == bf16.native_prompts
    assert fp32.plan(batch.layout).prefills  # the prompt on SDPA
    monkeypatch.setenv("CONVEYOR_NATIVE_PROMPTS", "1")
    assert cpu(torch.float32).native_prompts


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["qkv_views", "strided_heads"])
def test_write_and_attend_is_index_copy_then_the_kernel(dtype, layout, runnable):
    """The one-call layer step (torch_backend's all-native path) stores exactly what index_copy_
    stores and returns the kernel's own bits: K/V as views of one QKV GEMM output (the model's
    layout, copied row by row) and with heads not contiguous (index_copy_ itself)."""
    batch = random_batch([1, 3, 1, 7], [0, 40, 300, 17], block_size=16, num_kv_heads=2, group=3,
                         head_dim=64, dtype=dtype, seed=7)
    q, k, v = batch.q, batch.k, batch.v
    t, h, d = q.shape
    hkv = k.shape[1]
    if layout == "qkv_views":
        q, k, v = torch.cat((q, k, v), dim=1).split((h, hkv, hkv), dim=1)  # rows of H + 2Hkv heads
    else:
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    n = TorchBackend("cpu", native=True).plan(batch.layout).native
    assert n is not None
    slots = batch.layout.slot_mapping
    got_k, got_v = batch.k_cache.clone(), batch.v_cache.clone()
    got = torch.ops.conveyor_cpu.write_and_attend(
        q, k, v, got_k, got_v, slots, n.block_tables, n.q_start, n.q_len, n.seq_len, batch.scale,
        256, 0, 0.0, "auto")
    want_k, want_v = batch.k_cache.clone(), batch.v_cache.clone()
    for cache, x in ((want_k, batch.k), (want_v, batch.v)):
        cache.view(-1, hkv, d).index_copy_(0, slots, x)
    want = torch.empty_like(batch.q)
    torch.ops.conveyor_cpu.paged_attention(want, batch.q, want_k, want_v, n.block_tables,
                                           n.q_start, n.q_len, n.seq_len, batch.scale, 256, 0,
                                           0.0, "auto")
    stored_k, stored_v = batch.stored_caches()
    for cache, stored in ((got_k, stored_k), (got_v, stored_v)):
        assert torch.equal(cache.nan_to_num(nan=0.0), stored.nan_to_num(nan=0.0))
        assert torch.equal(cache.isnan(), stored.isnan())
    assert torch.equal(got, want)
