"""Every Triton kernel compiles for a real GPU (sm_90, H100/H200) without one, with the launch
configuration its launcher uses, and without register spills.

The interpreter checks none of the GPU's rules (tl.dot tile shapes >= 16, constexpr types,
register pressure), so this runs Triton's real compiler and its bundled ptxas down to a cubin.
It runs in a worker without TRITON_INTERPRET.
"""
from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Mapping

import pytest
import torch

from tests.kernels.triton_worker import run_isolated

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _compile(fn, config: Mapping[str, object], pointer_types: dict[str, str], cc: int = 90):
    """Compile fn for cc with config's constexprs, num_warps and num_stages; integers are i32,
    qk_scale fp32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = dict(config)
    options = {"num_warps": config.pop("num_warps", 4)}
    if "num_stages" in config:
        options["num_stages"] = config.pop("num_stages")
    signature = {}
    for name in fn.arg_names:
        if name in config:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    return triton.compile(ASTSource(fn, signature, config), target=GPUTarget("cuda", cc, 32),
                          options=options)


def _spills(kernel) -> str | None:
    """ptxas -v's spill line for the kernel's PTX, or None when it spills nothing."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o",
                              "/dev/null"], capture_output=True, text=True, check=True).stderr
    lines = [line.strip() for line in log.splitlines() if "spill" in line]
    assert lines, f"no ptxas -v report:\n{log}"
    return None if all(" 0 bytes spill stores, 0 bytes spill loads" in line
                       for line in lines) else " ".join(lines)


def _case_attention_kernels() -> None:
    from kernels.triton import decode, prefill

    dtypes = {torch.bfloat16: [(64, 1), (64, 8), (128, 1), (128, 4), (128, 8)],
              torch.float16: [(128, 4)], torch.float32: [(128, 4)]}
    problems = []
    for dtype, shapes in dtypes.items():
        t = "*" + TRITON_TYPES[dtype]
        for head_dim, group in shapes:
            num_kv_heads = 8
            h = group * num_kv_heads
            d_cfg = decode.decode_config(h, num_kv_heads, head_dim, 16, dtype, interpret=False)
            d_ptrs = dict(q_ptr=t, k_cache_ptr=t, v_cache_ptr=t, out_ptr=t, part_out_ptr="*fp32",
                          part_lse_ptr="*fp32", q_rows_ptr="*i32", seq_lens_ptr="*i32",
                          block_tables_ptr="*i32")
            knobs = prefill.prefill_knobs("sm90", head_dim, dtype, group)  # as launched there
            p_cfg = prefill.prefill_config(h, num_kv_heads, head_dim, 16, dtype, interpret=False,
                                           knobs=knobs)
            p_ptrs = dict(q_ptr=t, out_ptr=t, k_cache_ptr=t, v_cache_ptr=t, tile_seq_ptr="*i32",
                          tile_start_ptr="*i32", q_start_ptr="*i32", q_lens_ptr="*i32",
                          ctx_lens_ptr="*i32", block_tables_ptr="*i32")
            for name, fn, cfg, ptrs in [("decode", decode._decode_partition_kernel, d_cfg, d_ptrs),
                                        ("prefill", prefill._prefill_kernel, p_cfg, p_ptrs)]:
                spill = _spills(_compile(fn, cfg, ptrs))
                if spill:
                    problems.append(f"{name} {TRITON_TYPES[dtype]} d={head_dim} group={group}: "
                                    f"{spill}")
        r_ptrs = dict(out_ptr=t, part_out_ptr="*fp32", part_lse_ptr="*fp32", q_rows_ptr="*i32",
                      seq_lens_ptr="*i32")
        reduce = _compile(decode._decode_reduce_kernel, decode.reduce_config(128, 16), r_ptrs)
        assert _spills(reduce) is None
    assert not problems, "register spills:\n" + "\n".join(problems)


@pytest.mark.slow
def test_attention_kernels_compile_for_sm90() -> None:
    """Decode (+ reduce) and prefill, bf16/fp16/fp32, head dims 64 and 128, GQA 1..8."""
    run_isolated(_case_attention_kernels, interpret=False)


def _case_cache_kernels() -> None:
    from kernels.triton import cache_ops

    for dtype in TRITON_TYPES:
        t = "*" + TRITON_TYPES[dtype]
        for hkv, d in [(8, 128), (2, 64)]:
            store = _compile(cache_ops._store_kv_kernel, cache_ops.store_config(hkv, d, 16),
                             dict(k_ptr=t, v_ptr=t, k_cache_ptr=t, v_cache_ptr=t, slot_ptr="*i64"))
            assert _spills(store) is None
        move = _compile(cache_ops._move_blocks_kernel, cache_ops.move_config(16 * 8 * 128),
                        dict(src_ptr=t, dst_ptr=t, src_idx_ptr="*i64", dst_idx_ptr="*i64"))
        assert _spills(move) is None


@pytest.mark.slow
def test_cache_kernels_compile_for_sm90() -> None:
    """Store and block-move kernels, every dtype."""
    run_isolated(_case_cache_kernels, interpret=False)
