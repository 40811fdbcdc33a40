"""The Triton kernels compiled for a real GPU, against the PyTorch backend on the CPU.

Everywhere else the Triton tests run under TRITON_INTERPRET=1, which checks the arithmetic but none
of the GPU's rules (shared memory, tl.dot shapes, bfloat16 tensor cores, real launch grids). These
run the compiled kernels on CUDA, on the same random paged batches (scrambled tables, NaN-poisoned
caches) at the engine's own sizes, up to 4k tokens of context. Without a CUDA device they skip.
"""
from __future__ import annotations

import os

import pytest
import torch

from kernels.backend import BatchLayout
from kernels.torch_backend import TorchBackend
from tests.kernels.paged_batch import PagedBatch, random_batch, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device and the real Triton compiler (TRITON_INTERPRET unset)")

# (query lengths, context lengths): decodes of many lengths, a fresh prompt, chunks over a cached
# prefix, one 4k-token context.
STEPS = [
    ([1] * 8, [0, 15, 16, 17, 100, 511, 1024, 4095]),
    ([1, 1, 300, 1, 64], [31, 2000, 0, 7, 1500]),
    ([512, 1, 128], [4096 - 512, 900, 0]),
]
CASES = [(d, g, bs, dt) for d in (64, 128) for g in (1, 4, 8) for bs in (16, 32)
         for dt in ("float32", "bfloat16")]


def _to(batch: PagedBatch, device: str) -> PagedBatch:
    layout = batch.layout
    moved = BatchLayout(layout.query_lens, layout.context_lens, layout.block_tables,
                        layout.block_size, layout.slot_mapping.to(device))
    return PagedBatch(moved, *(t.to(device) for t in (batch.q, batch.k, batch.v, batch.k_cache,
                                                      batch.v_cache)))


def _oracle(batch: PagedBatch) -> torch.Tensor:
    """TorchBackend on the CPU in float32 on the same (rounded) inputs, NaN-free caches."""
    up = PagedBatch(batch.layout, batch.q.float(), batch.k.float(), batch.v.float(),
                    *(torch.nan_to_num(c.float(), nan=0.0) for c in (batch.k_cache, batch.v_cache)))
    backend = TorchBackend("cpu")
    return backend.forward(up.q, up.k, up.v, up.k_cache, up.v_cache, backend.plan(up.layout),
                           up.scale)


@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "split"])
@pytest.mark.parametrize("head_dim,group,block_size,dtype", CASES,
                         ids=[f"d{d}-g{g}-bs{b}-{t}" for d, g, b, t in CASES])
def test_backend_forward_on_cuda(head_dim: int, group: int, block_size: int, dtype: str,
                                 split: bool) -> None:
    """Output within tolerance of the fp32 oracle; caches after the store equal the expected ones
    bit for bit; the second layer's call on the same plan gives the same output."""
    from kernels.triton_backend import TritonBackend

    dt = getattr(torch, dtype)
    backend = TritonBackend("cuda",
                            **(dict(min_partition=16, target_programs=256) if split else {}))
    for i, (q_lens, ctx) in enumerate(STEPS):
        host = random_batch(q_lens, ctx, block_size=block_size, num_kv_heads=2, group=group,
                            head_dim=head_dim, dtype=dt,
                            seed=100 * i + head_dim + group + block_size)
        ref = _oracle(host)
        batch = _to(host, "cuda")
        meta = backend.plan(batch.layout)
        kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
        out = backend.forward(batch.q, batch.k, batch.v, kc, vc, meta, batch.scale)
        err = rel_err(out.cpu().float(), ref)
        tol = 1e-3 if dt == torch.float32 else 2e-2
        assert err < tol, f"step {i}: relative error {err} (tolerance {tol})"
        want_k, want_v = host.stored_caches()
        torch.testing.assert_close(kc.cpu(), want_k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(vc.cpu(), want_v, rtol=0, atol=0, equal_nan=True)
        again = backend.forward(batch.q, batch.k, batch.v, kc, vc, meta, batch.scale)
        torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_ops_on_cuda(dtype: str) -> None:
    """Copy-on-write within the GPU pool and swaps to and from pinned host memory equal the PyTorch
    backend's, bit for bit."""
    from kernels.triton_backend import TritonBackend

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(3)
    # [layers, K/V, blocks, bs, Hkv, D]
    pool = torch.randn(7, 2, 12, 16, 2, 64, generator=gen).to(dt)
    src, dst = torch.tensor([0, 3, 3, 5]), torch.tensor([1, 4, 6, 7])
    want = pool.clone()
    TorchBackend("cpu").copy_blocks(want, src, dst)
    got = pool.cuda()
    TritonBackend("cuda").copy_blocks(got, src.cuda(), dst.cuda())
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)

    host = torch.full((7, 2, 5, 16, 2, 64), float("nan"), dtype=dt).pin_memory()
    TritonBackend("cuda").swap_blocks(got, host, torch.tensor([2, 4]), torch.tensor([3, 0]))
    torch.testing.assert_close(host[:, :, [3, 0]], want[:, :, [2, 4]], rtol=0, atol=0)
    back = torch.full_like(got, float("nan"))
    TritonBackend("cuda").swap_blocks(host, back, torch.tensor([3, 0]), torch.tensor([9, 10]))
    torch.testing.assert_close(back[:, :, [9, 10]].cpu(), want[:, :, [2, 4]], rtol=0, atol=0)


@pytest.mark.slow
def test_engine_on_cuda_matches_across_backends(tiny_llama_dir) -> None:
    """The whole engine on the GPU, float32: the Triton backend gives the torch backend's greedy
    tokens through prefill, chunked prefill (a 16-token budget), prefix-cache hits and decode."""
    from engine.offline import LLM
    from shared.sampling import SamplingParams

    prompts = [[(5 * i + 1) % 97 for i in range(3)], [(11 * i + 2) % 97 for i in range(40)],
               [7] * 20 + [9, 10], [7] * 20 + [12], [(13 * i + 5) % 97 for i in range(70)]]
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_llama_dir), device="cuda", dtype="float32",
                  attention_backend=backend, max_num_batched_tokens=16, kv_cache_memory="64MiB")
        tokens[backend] = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 12 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_backend_on_cuda(dtype: str) -> None:
    """The PyTorch backend on the GPU (the Triton kernels' yardstick in bench/kernels.py) agrees
    with itself on the CPU, chunks over a cached prefix included: their masks take another form
    there."""
    dt = getattr(torch, dtype)
    backend = TorchBackend("cuda")
    for i, (q_lens, ctx) in enumerate(STEPS):
        host = random_batch(q_lens, ctx, block_size=16, num_kv_heads=8, group=4, head_dim=128,
                            dtype=dt, seed=7 + i)
        ref = _oracle(host)
        batch = _to(host, "cuda")
        k_cache, v_cache = (torch.nan_to_num(c, nan=0.0) for c in (batch.k_cache, batch.v_cache))
        out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache,
                              backend.plan(batch.layout), batch.scale)
        err = rel_err(out.cpu().float(), ref)
        assert err < (1e-3 if dt == torch.float32 else 2e-2), f"step {i}: relative error {err}"
