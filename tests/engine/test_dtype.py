"""--dtype auto: bfloat16 only where the CPU runs it natively and the checkpoint is 16-bit or
quantized; the engine's model, KV cache and sampling all follow what it resolved to."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.core import EngineCore
from engine.load import dtype as engine_dtype
from engine.load.dtype import resolve_dtype
from engine.load.gguf_config import gguf_dtype
from shared.config import build_config
from shared.sampling import SamplingParams
from tests.conftest import request_outputs

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("declared, native, device, expected", [
    (None, True, CPU, torch.float32),  # a config that says nothing is read as float32
    # a float32 checkpoint stays float32, as with transformers
    ("float32", True, CPU, torch.float32),
    ("bfloat16", True, CPU, torch.bfloat16),
    # CPUs have no fast float16 GEMM; bfloat16 has float32's range
    ("float16", True, CPU, torch.bfloat16),
    ("bfloat16", False, CPU, torch.float32),  # emulated bfloat16 would be ~100x slower
    ("float16", False, CPU, torch.float32),
    ("float16", False, CUDA, torch.float16),
    ("bfloat16", False, CUDA, torch.bfloat16),
    ("float32", False, CUDA, torch.float32),
])
def test_auto_follows_checkpoint_and_hardware(declared, native, device, expected) -> None:
    assert resolve_dtype("auto", declared, device, native_bf16=native) == expected


def test_explicit_dtype_is_kept_and_warned_about_where_emulated(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor.dtype"):
        assert resolve_dtype("bfloat16", "float32", CPU, native_bf16=False) == torch.bfloat16
    assert "about 100x" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="conveyor.dtype"):
        assert resolve_dtype("bfloat16", "float32", CPU, native_bf16=True) == torch.bfloat16
        assert resolve_dtype("float32", "bfloat16", CPU, native_bf16=False) == torch.float32
    assert caplog.text == ""


def test_gguf_precision_comes_from_its_matrices() -> None:
    assert gguf_dtype({Q.F32}) == "float32"
    assert gguf_dtype({Q.F32, Q.F16}) == "float16"
    assert gguf_dtype({Q.F32, Q.BF16}) == "bfloat16"
    assert gguf_dtype({Q.Q4_1, Q.Q8_0, Q.F32}) == "bfloat16"


@pytest.mark.parametrize("native", [True, False])
def test_engine_builds_model_and_cache_in_the_resolved_dtype(tiny_llama_dir, tmp_path, monkeypatch,
                                                             native) -> None:
    folder = tmp_path / "bf16-checkpoint"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"  # as transformers v5 saves a bfloat16 model
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(engine_dtype, "cpu_has_native_bf16", lambda: native)
    core = EngineCore(build_config(str(folder), num_blocks=32, block_size=8))
    want = torch.bfloat16 if native else torch.float32
    assert core.model_config.dtype == str(want).removeprefix("torch.")
    assert {p.dtype for p in core.runner.model.parameters()} == {want}
    assert core.runner.kv_cache.device.dtype == core.runner.kv_cache.cpu.dtype == want
    core.add("r", [1, 5, 9, 13], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    out: list[int] = []
    while core.has_work():
        out += [t for o in request_outputs(core.step()) for t in o.new_token_ids]
    assert len(out) == 6 and all(0 <= t < 512 for t in out)


def _greedy(core: EngineCore, prompts: list[list[int]],
            max_tokens: int) -> list[list[tuple[int, list]]]:
    """-> per prompt, (token, [its logprob, top-5 [[id, logprob], ...]]) per generated token."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        core.add(f"r{i}", p, params)
    out: dict[str, list[tuple[int, list]]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work():
        for o in request_outputs(core.step()):
            assert o.logprobs is not None  # asked for: one entry per token
            out[o.request_id] += list(zip(o.new_token_ids, o.logprobs))
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_bfloat16_kv_cache_under_a_float32_model(tiny_llama_dir) -> None:
    """--kv-cache-dtype bfloat16: twice the blocks in the same memory, K/V stored in bfloat16 (the
    swap pool too), the model in float32. Greedy output follows the float32 cache's token for
    token, with logprobs within bfloat16's rounding, up to a point where float32 itself nearly
    tied (if any)."""
    options = dict(kv_cache_memory="256KiB", swap_space="256KiB", block_size=8)
    plain = EngineCore(build_config(str(tiny_llama_dir), **options))
    half = EngineCore(build_config(str(tiny_llama_dir), kv_cache_dtype="bfloat16", **options))
    assert half.block_manager.num_blocks == 2 * plain.block_manager.num_blocks
    assert half.runner.kv_cache.device.dtype == half.runner.kv_cache.cpu.dtype == torch.bfloat16
    assert {p.dtype for p in half.runner.model.parameters()} == {torch.float32}
    prompts = [[1 + (7 * i + 3 * j) % 500 for j in range(5 + 9 * i)] for i in range(6)]
    same = 0
    for got, want in zip(_greedy(half, prompts, 24), _greedy(plain, prompts, 24)):
        for (tok, (lp, _)), (ref_tok, (ref_lp, ref_top)) in zip(got, want):
            # a near tie in float32: the token taken is float32's runner-up, by a hair
            if tok != ref_tok:
                assert ref_top[1][0] == tok and ref_top[0][1] - ref_top[1][1] < 0.05, (ref_top, tok)
                break
            assert abs(lp - ref_lp) < 0.05
            same += 1
    # Where the first near tie falls is luck (the native kernel's float32 sums over the
    # bfloat16 cache meet one at token 7 of one prompt); each divergence above is a near tie,
    # and most tokens agree.
    assert same >= 0.6 * 6 * 24


def test_kv_cache_dtype_other_than_the_model_needs_the_torch_backend(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="only the cpu and torch attention backends"):
        EngineCore(build_config(str(tiny_llama_dir), kv_cache_dtype="bfloat16",
                                attention_backend="triton", num_blocks=16))
