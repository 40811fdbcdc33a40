"""Quantized GGUF weights served as int8 / int4 weight-only GEMMs (engine/load/quant.py).

The GGUF is written by the `gguf` package's own writer and quantizer from a tiny transformers
checkpoint (Q4_0 projections, a Q8_0 tied embedding, F32 norms, q/k rows permuted as llama.cpp's
converter does). The float reference is transformers' own GGUF loader (dequantize, then float32)."""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine import kernel_calibration
from engine.core import EngineCore
from engine.load import amx, int4_avx2, int4_avx512
from engine.load.dtype import cpu_kind
from engine.load.prepack import PackedLinear
from engine.load.quant import Int4Linear, Int8Linear
from engine.load.quantize import weight_bytes
from engine.load.weights import load_model
from engine.models.llama import to_interleaved
from engine.models.native_stack import INT4_AVX512
from kernels.backend import BatchLayout
from kernels.torch_backend import TorchBackend
from shared.config import build_config
from shared.model_source import resolve_model
from shared.sampling import SamplingParams
from tests.conftest import causal_lm, decoder_layers, request_outputs
from tests.reference import hf_greedy, transformers_gguf_model

# Max |logit difference| from the dequantized float32 model. The Q4_0 projections are carried over
# bit for bit (float rounding only, about 1e-4); the Q8_0 embedding (also the LM head) is
# re-quantized to one scale per row: measured 0.08 (int4 projections) and 0.19 (int8 everywhere) on
# this tiny model, whose logits reach about 10 in magnitude.
TOLERANCE = 0.3
# w4a8 adds the activations' rounding to 8 bits per group of 32 in every projection: measured 0.36.
W4A8_TOLERANCE = 0.6
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gguf(folder: Path, path: Path, arch: str = "llama") -> Path:
    """A GGUF of the HF checkpoint in folder: Q4_0 projections, Q8_0 tied embedding, F32 norms.
    llama.cpp permutes q/k rows only for "llama"."""
    import json

    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    c = json.loads((folder / "config.json").read_text())
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c["vocab_size"])])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    heads = {"self_attn.q_proj": c["num_attention_heads"],
             "self_attn.k_proj": c["num_key_value_heads"]}
    for name, t in load_file(folder / "model.safetensors").items():
        if name == "lm_head.weight":
            continue  # tied: the embedding is the head, as in SmolLM2
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            if module in heads and arch == "llama":
                t = to_interleaved(t, heads[module])  # llama.cpp's q/k row order
            gname = f"blk.{i}.{_LAYER[module]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight"}[name]
        a = t.float().numpy()
        if a.ndim == 1:
            w.add_tensor(gname, a)
            continue
        qtype = Q.Q8_0 if gname == "token_embd.weight" else Q.Q4_0
        w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny-q4.gguf")


def test_qwen3_gguf_loads_through_llama_cpp_names(tmp_path, make_tiny_checkpoint):
    """Qwen3 as llama.cpp writes it (per-head q/k norms, rows not permuted), Q4_0 served as int4."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim left at Qwen3's 128: transformers' GGUF loader (the reference) ignores the
    # file's key_length.
    folder = make_tiny_checkpoint(tmp_path / "hf", Qwen3Config, Qwen3ForCausalLM,
                                  tie_word_embeddings=True)
    source = resolve_model(str(write_gguf(folder, tmp_path / "tiny-qwen3.gguf", "qwen3")))
    ids = random.Random(2).sample(range(3, 512), 30)
    with torch.no_grad():
        ref = transformers_gguf_model(source)(torch.tensor([ids])).logits[0]
    plain, cfg = load_model(source, torch.float32, "cpu", "none")
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm
    torch.testing.assert_close(logits(plain, cfg, ids), ref, atol=1e-4, rtol=1e-4)
    model, cfg = load_model(source, torch.float32, "cpu", "int4")
    assert cfg.quantization == "int4" and (logits(model, cfg, ids) - ref).abs().max() < TOLERANCE


def kernel_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes of the copies a quantized model holds for its kernels, beside its codes: packed float
    copies, and the int8 AVX2 kernel's repacked codes where the [N, K] ones stay too. Which exist
    depends on the CPU kind."""
    packed = sum(weight_bytes(m) for m in model.modules() if isinstance(m, PackedLinear))
    return packed + sum(m.avx2_codes.numel() for m in model.modules()
                        if isinstance(m, Int8Linear) and m.avx2_codes is not None
                        and m.qweight is not None)


def dense_bytes(model: torch.nn.Module) -> int:
    """weight_bytes of a dense model with each matrix counted once: a PackedLinear keeps a plain
    copy for small calls only on CPU kinds where MKL's plain matrix wins (engine/load/prepack.py
    plain_from_rows), so its total depends on the CPU."""
    return weight_bytes(model) - sum(weight_bytes(m) - m.packed.numel() * m.packed.element_size()
                                     for m in model.modules() if isinstance(m, PackedLinear))


def logits(model, cfg, ids: list[int]) -> torch.Tensor:
    """Our model's logits at every position of one sequence, through the paged cache."""
    backend = TorchBackend("cpu")
    kv = torch.zeros(cfg.num_layers, 2, 8, 16, cfg.num_kv_heads, cfg.head_dim,
                     dtype=getattr(torch, cfg.dtype))
    n = len(ids)
    layout = BatchLayout([n], [0], [list(range(8))], 16, torch.arange(n))
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(n), kv, backend.plan(layout), backend,
                     torch.arange(n))


def test_q4_0_and_q8_0_gguf_loads_small_and_matches_the_dequantized_model(tiny_gguf):
    source = resolve_model(str(tiny_gguf))
    ids = random.Random(0).sample(range(3, 512), 40)
    hf = transformers_gguf_model(source)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [40, V] transformers: dequantize, then float32
    plain, _ = load_model(source, torch.float32, "cpu", "none")
    for mode in ("int4", "int8", *(("w4a8",) if int4_avx2.usable() else ())):
        model, cfg = load_model(source, torch.float32, "cpu", mode)
        layer = decoder_layers(model)[0]
        kind = Int8Linear if mode == "int8" else Int4Linear
        assert cfg.quantization == mode
        assert isinstance(layer.qkv_proj, kind) and isinstance(layer.down_proj, kind)
        assert isinstance(causal_lm(model).model.embed_tokens, Int8Linear)
        # the codes, against the float32 matrices once each: copies for a kernel come on top
        # (float32 copies for large calls where the AVX2 int4 kernel runs: engine/kernel_choice.py
        # attach_float32_copies; the int8 AVX2 kernel's repacked codes)
        assert weight_bytes(model) - kernel_copy_bytes(model) < dense_bytes(plain) / 3
        diff = (logits(model, cfg, ids) - ref).abs().max().item()
        assert diff < (W4A8_TOLERANCE if mode == "w4a8" else TOLERANCE), \
            f"{mode}: max |logit diff| {diff}"
    # int4 from Q4_0 is exact: with the embedding left in float32, only float rounding remains.
    exact, cfg = load_model(source, torch.float32, "cpu", "int4")
    causal_lm(exact).model.embed_tokens = causal_lm(plain).model.embed_tokens
    torch.testing.assert_close(logits(exact, cfg, ids), ref, atol=1e-3, rtol=1e-3)
    # auto: the file's 4-bit codes as int4 under 16-bit activations; under float32 as w4a8 where
    # the AVX2 int4 kernel runs, else dequantized (torch's int kernels are slow there).
    assert load_model(source, torch.bfloat16, "cpu", "auto")[1].quantization == "int4"
    under_float32 = "w4a8" if int4_avx2.usable() else "none"
    assert load_model(source, torch.float32, "cpu", "auto")[1].quantization == under_float32


def test_engine_serves_the_quantized_gguf_end_to_end(tiny_gguf):
    """Greedy through chunked prefill and batching; the tokens are compared with transformers' float
    model of the same file, and most agree (re-quantizing the Q8_0 head may flip close calls)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 50))] for _ in range(6)]
    core = EngineCore(build_config(str(tiny_gguf), dtype="float32", quantization="int4",
                                   num_blocks=64, block_size=16, max_num_batched_tokens=32,
                                   num_threads=1))
    assert core.model_config.quantization == "int4"
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work():
        for o in request_outputs(core.step()):
            out[o.request_id] += o.new_token_ids
    ref = hf_greedy(transformers_gguf_model(resolve_model(str(tiny_gguf))), prompts, 10)
    ours = [out[f"r{i}"] for i in range(len(prompts))]
    assert all(len(t) == 10 for t in ours)
    first = np.mean([a[0] == b[0] for a, b in zip(ours, ref)])
    assert first >= 5 / 6, (ours, ref)


@pytest.mark.slow
def test_default_model_served_quantized_answers_the_readme_example():
    """README's offline example, served as the file's int4 codes and dequantized, both under --dtype
    auto (bfloat16 where the CPU has it natively, which is also where --quantization auto picks
    int4). The two greedy texts are printed (pytest -s) for the record, not asserted equal: int4
    rounds differently."""
    from engine.offline import LLM

    params = SamplingParams(temperature=0, max_tokens=16)
    texts: dict[str, str | None] = {}  # None: no tokenizer, which this model has
    for quant in ("int4", "none"):
        llm = LLM("SmolLM2-135M-Instruct", quantization=quant, kv_cache_memory="64MiB",
                  num_threads=1)
        texts[llm.core.model_config.quantization] = llm.generate(["The capital of France is"],
                                                                 params, use_tqdm=False)[0].text
        del llm
    print(f"\nint4: {texts['int4']!r}\nfloat32 (dequantized): {texts['none']!r}")
    int4 = texts["int4"]
    assert int4 is not None and "Paris" in int4


# --- The kernel each quantized GEMM runs, by rows (engine/kernel_choice.py) ---

# Max |y - reference| over max |reference|. Activations and outputs are bfloat16 (relative rounding
# 2^-8 = 0.4%); the packed copy also holds each dequantized weight rounded to bfloat16. Measured on
# these random matrices: 0.1-0.3% for every kernel and row count; all scales 5% off gives 4.6%, rows
# or groups out of order over 100%.
KERNEL_TOLERANCE = 1.5e-2
ROWS = (1, 7, 32, 300)
needs_bf16_packing = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN cannot pack bfloat16 matrices on this CPU (no AVX-512 BW/VL/DQ or "
           "AVX-NE-CONVERT)")


def _int4_layer(n: int = 96, k: int = 128, seed: int = 0) -> tuple[Int4Linear, torch.Tensor]:
    """An int4 projection from known codes and groups -> (module, its dequantized matrix in float32,
    from the codes and the bfloat16 scales and zeros the kernel holds: (q - 8) * scale + zero)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g).float()
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    low = -torch.rand(n, k // 32, generator=g) * 0.1
    w = (q.view(n, -1, 32) * scale[..., None] + low[..., None]).view(n, k)
    module = Int4Linear(w, None, torch.bfloat16, (scale, low))
    s, z = module.scales_zeros.float().unbind(-1)  # [K/32, N] each
    ref = (q.view(n, -1, 32) - 8) * s.t()[..., None] + z.t()[..., None]
    return module, ref.view(n, k)


def _int8_layer(n: int = 96, k: int = 128, seed: int = 0) -> tuple[Int8Linear, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    module = Int8Linear(w, None, torch.bfloat16)
    return module, module.codes().float() * module.scales.float()[:, None]


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@needs_bf16_packing
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("kernel", ["int", "packed"])
def test_each_quantized_kernel_equals_dequantize_then_matmul(kind: str, kernel: str,
                                                             rows: int) -> None:
    module, w = _int4_layer() if kind == "int4" else _int8_layer()
    module.packed = PackedLinear(module.dequantized(), None)
    module.packed_from = 1 if kernel == "packed" else 1 << 62
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    h = torch.randn(rows, w.shape[0]).bfloat16()
    ref = x.float() @ w.t()
    with torch.inference_mode():
        assert _relative_error(module(x), ref) < KERNEL_TOLERANCE
        assert _relative_error(module.add_to(h, x), h.float() + ref) < KERNEL_TOLERANCE


@needs_bf16_packing
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_row_threshold_is_honoured_on_both_sides(kind: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.load.prepack import PackedLinear

    module, w = _int4_layer() if kind == "int4" else _int8_layer()
    module.packed, module.packed_from = PackedLinear(module.dequantized(), None), 8
    calls: list[str] = []
    packed_forward, packed_add = PackedLinear.forward, PackedLinear.add_to
    int_mm = type(module).quantized_mm

    def counted(name: str, f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: Any) -> torch.Tensor:
            calls.append(name)
            return f(*args)
        return call

    monkeypatch.setattr(PackedLinear, "forward", counted("packed", packed_forward))
    monkeypatch.setattr(PackedLinear, "add_to", counted("packed", packed_add))
    monkeypatch.setattr(type(module), "quantized_mm", counted("int", int_mm))
    with torch.inference_mode():
        for rows, want in ((1, "int"), (7, "int"), (8, "packed"), (300, "packed")):
            x = torch.randn(rows, w.shape[1]).bfloat16()
            calls.clear()
            module(x)
            module.add_to(torch.zeros(rows, w.shape[0], dtype=torch.bfloat16), x)
            assert calls == [want, want], (rows, calls)


@needs_bf16_packing
def test_load_gives_copies_from_the_cpu_kinds_table_or_a_calibration(tiny_gguf,
                                                                     monkeypatch) -> None:
    from engine import kernel_choice
    from engine.load import prepack

    source = resolve_model(str(tiny_gguf))
    table = {cpu_kind(): {torch.get_num_threads(): {"int4": 5, "int8": 3}}}
    monkeypatch.setattr(prepack, "QUANTIZED_PACKED_FROM_ROWS", table)
    # the switching kernels, as on the CPU kinds whose default is not invariant
    monkeypatch.setattr(kernel_choice, "INVARIANT_KINDS", frozenset())
    if amx.usable():  # AMX CPUs: int4 takes the tiles from 2 rows and hands over to the copy from 6
        monkeypatch.setattr(kernel_choice, "QUANTIZED_TILES_ROWS",
                            {torch.get_num_threads(): (2, 6)})
        model, _ = load_model(source, torch.bfloat16, "cpu", "int4")
        qkv, embed = decoder_layers(model)[0].qkv_proj, causal_lm(model).model.embed_tokens
        assert isinstance(qkv, Int4Linear) and isinstance(embed, Int8Linear)
        assert (qkv.amx_from, qkv.packed_from, embed.packed_from) == (2, 6, 3)
    monkeypatch.setattr(kernel_choice, "QUANTIZED_TILES_ROWS", {})
    model, cfg = load_model(source, torch.bfloat16, "cpu", "int4")
    qkv, embed = decoder_layers(model)[0].qkv_proj, causal_lm(model).model.embed_tokens
    assert isinstance(qkv, Int4Linear) and isinstance(embed, Int8Linear)
    assert cfg.quantization == "int4" and qkv.packed is not None
    assert qkv.packed_from == 5 and embed.packed_from == 3  # the tied head is the embedding
    ids = random.Random(3).sample(range(3, 512), 40)
    full = logits(model, cfg, ids)  # 40 rows: the packed copies (the head too)
    for m in kernel_choice.switched_modules(model):
        m.packed_from = kernel_calibration.NEVER
    # the int kernels at every row count
    assert (full - logits(model, cfg, ids)).abs().max() < TOLERANCE
    # an unmeasured kind: calibrated at load
    monkeypatch.setattr(prepack, "QUANTIZED_PACKED_FROM_ROWS", {})
    model, _ = load_model(source, torch.bfloat16, "cpu", "int4")
    chosen = {m.packed_from for m in kernel_choice.switched_modules(model) if m.packed is not None}
    assert chosen <= set(kernel_calibration.CALIBRATION_ROWS)
    # In float32, copies only where the int4 matrices carry the AVX2 kernel's codes. The int8 head
    # then runs its own AVX2 kernel below a row count calibrated at load, on its copy from there
    # (no copy where the kernel won at every row count tried: engine/kernel_choice.py
    # attach_int8_avx2). Which it is depends on this CPU's timings.
    model, _ = load_model(source, torch.float32, "cpu", "int4")
    modules = kernel_choice.switched_modules(model)
    if int4_avx2.usable():
        heads = [m for m in modules if isinstance(m, Int8Linear)]
        assert heads and all(m.amx_from == 1 for m in heads)
        assert all(m.packed_from in kernel_calibration.INT8_CALIBRATION_ROWS
                   if m.packed is not None else m.packed_from == kernel_calibration.NEVER
                   for m in heads)
    else:
        assert all(m.packed is None for m in modules)
    monkeypatch.setattr(kernel_choice, "PLAIN_MAX_BYTES", 1000)
    model, _ = load_model(source, torch.bfloat16, "cpu", "int4")
    assert all(m.packed is None for m in kernel_choice.switched_modules(model))


@needs_bf16_packing
def test_deterministic_loads_take_one_kernel_at_every_row_count(tiny_gguf) -> None:
    """--deterministic: every quantized matrix on its packed copy from one row (no switch by row
    count, which would round a row differently in small and large steps), one-row calls padded; on
    AMX CPUs every matrix (int4 and the int8 head) on its AMX kernel at every row count instead,
    with no copy."""
    from engine import kernel_choice

    model, _ = load_model(resolve_model(str(tiny_gguf)), torch.bfloat16, "cpu", "int4",
                          deterministic=True)
    modules = kernel_choice.switched_modules(model)
    tiled = [m for m in modules if getattr(m, "tile_codes", None) is not None]
    assert bool(tiled) == (amx.usable() or int4_avx512.usable())
    assert all(m.amx_from == 1 and m.packed is None for m in tiled)
    copied = [m for m in modules if m not in tiled]
    assert bool(copied) != amx.usable()
    assert all(m.packed is not None and m.packed_from == 1 for m in copied)
    assert all(m.packed.pad_one_row for m in copied if m.packed is not None)
    from engine.load.prepack import same_bits_rows

    cut = same_bits_rows(True)
    assert all(m.packed.max_rows == cut for m in copied if m.packed is not None)


@needs_bf16_packing
def test_the_default_takes_one_kernel_at_every_row_count_on_amx_cpus(tiny_gguf) -> None:
    """Issue #30: on AMX CPUs the quantized default is what --deterministic loads (the int4
    matrices on the int4 AMX kernel from one row, the int8 head on the int8 one), since that costs
    no served throughput there (docs/determinism.md); elsewhere it switches kernels (on AVX-512
    BF16 CPUs where their int4 kernel lags the packed copies on prompts, below)."""
    from engine import kernel_choice

    model, _ = load_model(resolve_model(str(tiny_gguf)), torch.bfloat16, "cpu", "int4")
    modules = kernel_choice.switched_modules(model)
    tiled = [m for m in modules if getattr(m, "tile_codes", None) is not None]
    int4 = [m for m in modules if isinstance(m, Int4Linear)]
    head = [m for m in modules if isinstance(m, Int8Linear)]
    assert kernel_choice.invariant_by_default(modules, torch.bfloat16, "AMX") == amx.usable()
    assert not kernel_choice.invariant_by_default(modules, torch.bfloat16, "AVX512")
    assert not kernel_choice.invariant_by_default(modules, torch.float32, "AMX")
    if amx.usable():
        assert head and len(tiled) == len(int4) + len(head) and all(m in tiled for m in int4 + head)
        assert all(m.amx_from == 1 and m.packed is None for m in tiled)


needs_avx512_bf16 = pytest.mark.skipif(not int4_avx512.usable(),
                                       reason="this CPU lacks avx512_bf16")
HANDOVER = 8  # the int4 handover a forced calibration reports in the AVX512_BF16 default's test


def recording(f: Callable[..., torch.Tensor], rows: list[int],
              arg: int = 0) -> Callable[..., torch.Tensor]:
    """f, appending the rows of its argument `arg` (1 for a method's x) to rows at each call."""
    def call(*args: Any) -> torch.Tensor:
        rows.append(args[arg].shape[0])
        return f(*args)
    return call


def load_as_avx512_bf16(tiny_gguf, monkeypatch, deterministic: bool
                        ) -> tuple[Any, Any, list[Int4Linear], list[Any], list[str], list[int]]:
    """The tiny model loaded as on the AMD EPYC kind (cpu_kind AVX512_BF16, AMX unusable), with
    every int4 kernel call recorded: -> (model, cfg, int4 modules, the others, the kernels each int4
    calibration timed, the rows of each AVX-512 BF16 kernel call). An int4 calibration runs for
    real and then reports HANDOVER, so the test knows the threshold the load applied."""
    from engine import kernel_choice

    monkeypatch.setattr(kernel_choice, "cpu_kind", lambda: "AVX512_BF16")
    monkeypatch.setattr(amx, "usable", lambda: False)  # as there: no AMX
    timed: list[str] = []
    rows: list[int] = []

    def spy(name: str, f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(x: torch.Tensor, *args: Any) -> torch.Tensor:
            timed.append(name)
            if name == "avx512":
                rows.append(x.shape[0])
            return f(x, *args)
        return call

    for name in ("int4_mm", "int4_mm_tiles", "int4_mm_rows"):
        monkeypatch.setattr(amx, name, spy("amx", getattr(amx, name)))
    monkeypatch.setattr(int4_avx512, "int4_mm", spy("avx512", int4_avx512.int4_mm))
    torch_int4 = Int4Linear.quantized_mm
    monkeypatch.setattr(Int4Linear, "quantized_mm",
                        lambda m, x: spy("torch", lambda x: torch_int4(m, x))(x))
    calibrated: list[str] = []
    real = kernel_calibration.calibrate

    def calibrate(modules: Any, *args: Any) -> int:
        del timed[:]
        found = real(modules, *args)
        if not all(isinstance(m, Int4Linear) for m in modules):
            return found
        calibrated.extend(timed)
        return HANDOVER

    monkeypatch.setattr(kernel_choice, "calibrate", calibrate)
    model, cfg = load_model(resolve_model(str(tiny_gguf)), torch.bfloat16, "cpu", "int4",
                            deterministic=deterministic)
    modules = kernel_choice.switched_modules(model)
    int4 = [m for m in modules if isinstance(m, Int4Linear)]
    del rows[:]
    return model, cfg, int4, [m for m in modules if m not in int4], calibrated, rows


def check_the_avx512_bf16_default(tiny_gguf, monkeypatch) -> None:
    """The default's contract on that kind (the test below, and its mutation check)."""
    from engine import kernel_choice

    int8_rows: list[int] = []
    torch_int8 = Int8Linear.quantized_mm

    def no_torch_int8(m: Int8Linear, x: torch.Tensor) -> torch.Tensor:
        int8_rows.append(-1)
        return torch_int8(m, x)

    monkeypatch.setattr(amx, "int8_mm_rows", recording(amx.int8_mm_rows, int8_rows))
    monkeypatch.setattr(Int8Linear, "quantized_mm", no_torch_int8)
    model, cfg, int4, head, calibrated, rows = load_as_avx512_bf16(tiny_gguf, monkeypatch, False)
    # the head's calibration timed the rows path at its row counts, never torch's int8 kernel
    assert set(int8_rows) == set(kernel_calibration.INT8_CALIBRATION_ROWS)
    # below the handover the AVX-512 BF16 kernel, from it the packed copy, which a calibration
    # timed against that kernel (never AMX, nor torch's int4 kernel the static table timed)
    assert calibrated and set(calibrated) == {"avx512"}
    assert int4 and all(m.tiles_avx512 and m.amx_from == 1 and m.packed is not None
                        and m.packed_from == HANDOVER for m in int4)
    assert not kernel_choice.invariant_by_default(int4 + head, torch.bfloat16, "AVX512_BF16")
    # the native layer stack takes the same kernel below the handover and the copy from it
    stack = causal_lm(model).native_stack
    assert stack is not None and stack.projections == [INT4_AVX512, HANDOVER, -1] * len(int4)
    # the int8 head on the int8 kernel's rows path below its copy's rows, calibrated against it
    # (the real calibration: none where the rows path won at every row count tried)
    assert head and all(m.tiles_avx512 and m.amx_from == 1 and (m.packed is None) ==
                        (m.packed_from >= kernel_calibration.NEVER) for m in head)
    assert all(m.packed is None or not m.packed.pad_one_row for m in head)
    short = random.Random(5).sample(range(3, 512), HANDOVER - 1)
    fast = logits(model, cfg, short)
    assert rows and set(rows) == {HANDOVER - 1}
    del rows[:]
    logits(model, cfg, short + [7])
    assert not rows
    # against the same weights through torch's int4 kernel: within the int4 tolerance
    for m in int4:
        m.amx_from = kernel_calibration.NEVER
    assert (fast - logits(model, cfg, short)).abs().max() < TOLERANCE


@needs_bf16_packing
@needs_avx512_bf16
@pytest.mark.parametrize("invariant", [False, True])
def test_avx512_bf16_cpus_hand_over_to_copies_where_their_int4_kernel_is_slow_on_prompts(
        tiny_gguf, monkeypatch, invariant: bool) -> None:
    """Issues #25 and #30 on the AMD EPYC kind, where the load times the AVX-512 BF16 int4 kernel
    past AVX512_INVARIANT_RATIO of the packed copies' time on prompts: by default the int4 matrices
    multiply on kernels/cpu/quant_gemm_avx512.cpp in place of torch's int4 kernel for few rows and
    hand over to their packed copies from a threshold calibrated against it on the CPU that runs
    it, so the default is not invariant there. invariant: the mutation, the kernel timed at the
    bound (which counts as keeping up), must fail the check."""
    from engine import kernel_choice

    bound = kernel_calibration.AVX512_INVARIANT_RATIO
    monkeypatch.setattr(kernel_choice, "prompt_ratio",
                        lambda modules: bound if invariant else bound + 0.01)
    if not invariant:
        check_the_avx512_bf16_default(tiny_gguf, monkeypatch)
        return
    with pytest.raises(AssertionError):
        check_the_avx512_bf16_default(tiny_gguf, monkeypatch)


@needs_bf16_packing
@needs_avx512_bf16
@pytest.mark.parametrize("deterministic", [True, False])
def test_avx512_bf16_cpus_take_the_avx512_int4_kernel_at_every_row_count(
        tiny_gguf, monkeypatch, deterministic: bool) -> None:
    """The AMD EPYC kind under --deterministic, and by default where the load times the AVX-512
    BF16 int4 kernel within AVX512_INVARIANT_RATIO of the packed copies on prompts (issue #30: the
    quantized default batch-invariant there): every int4 matrix on kernels/cpu/quant_gemm_avx512.cpp
    at every row count (no packed copy, no AMX; the native layer stack, where a step takes it, on
    the same kernel), the int8 head on the int8 kernel's rows path (the AMX tiles' bits on AVX-512,
    5 rows at a time; no copy); one row and a prompt take those kernels alone."""
    from engine import kernel_choice

    def keeps_up(modules: Any) -> float:
        assert not deterministic, "the flag needs no timing"
        return kernel_calibration.AVX512_INVARIANT_RATIO

    monkeypatch.setattr(kernel_choice, "prompt_ratio", keeps_up)
    model, cfg, int4, head, calibrated, rows = load_as_avx512_bf16(tiny_gguf, monkeypatch,
                                                                   deterministic)
    assert not calibrated
    assert int4 and all(m.tiles_avx512 and m.amx_from == 1 and m.packed is None for m in int4)
    stack = causal_lm(model).native_stack
    assert stack is not None and stack.projections == [INT4_AVX512, -1, -1] * len(int4)
    assert head and all(m.tiles_avx512 and m.amx_from == 1 and m.packed is None for m in head)
    head_rows: list[int] = []

    def no_tiles(*args: Any) -> torch.Tensor:
        raise AssertionError("the int8 AMX tiles on a CPU without AMX")

    monkeypatch.setattr(amx, "int8_mm_rows", recording(amx.int8_mm_rows, head_rows))
    monkeypatch.setattr(amx, "int8_mm", no_tiles)
    ids = random.Random(5).sample(range(3, 512), 40)
    full = logits(model, cfg, ids)
    logits(model, cfg, ids[:1])
    assert rows and set(rows) == {40, 1}
    assert head_rows and set(head_rows) <= {40, 1}
    # against the same weights through torch's int4 kernel: within the int4 tolerance
    for m in int4:
        m.amx_from = kernel_calibration.NEVER
    assert (full - logits(model, cfg, ids)).abs().max() < TOLERANCE


@needs_bf16_packing
@needs_avx512_bf16
def test_the_prompt_ratio_times_the_avx512_int4_kernel_against_copies_it_drops(
        tiny_gguf, monkeypatch) -> None:
    """What the AMD EPYC kind's default decides from (kernel_calibration.prompt_ratio): the AVX-512
    BF16 int4 kernel and packed bfloat16 copies of the same matrices, each at PROMPT_ROWS; the
    copies are gone after the timing (no 2 bytes a weight kept for nothing) and the modules are
    as they came."""
    from engine import kernel_choice

    model, _ = load_model(resolve_model(str(tiny_gguf)), torch.bfloat16, "cpu", "int4")
    int4 = [m for m in kernel_choice.switched_modules(model) if isinstance(m, Int4Linear)]
    assert int4 and all(m.tile_codes is not None for m in int4)
    state = [(m.tiles_avx512, m.packed, m.packed_from, m.amx_from) for m in int4]
    kernel_rows: list[int] = []
    copy_rows: list[int] = []
    monkeypatch.setattr(int4_avx512, "int4_mm", recording(int4_avx512.int4_mm, kernel_rows))
    monkeypatch.setattr(PackedLinear, "forward", recording(PackedLinear.forward, copy_rows, 1))
    ratio = kernel_calibration.prompt_ratio(int4)
    assert 0 < ratio < float("inf")
    sample = min(len(int4), kernel_calibration.CALIBRATION_MATRICES)
    assert kernel_rows == copy_rows == [kernel_calibration.PROMPT_ROWS] * (sample * 4)
    assert [(m.tiles_avx512, m.packed, m.packed_from, m.amx_from) for m in int4] == state


def test_calibration_takes_the_first_row_count_from_which_the_copy_stays_faster(
        monkeypatch) -> None:

    rows = [1, 2, 4, 8, 16]
    inf = float("inf")  # no AMX codes
    times = {"flip": [(1, 1.0, 2.0, inf), (2, 1.0, 0.5, inf), (4, 1.0, 2.0, inf),
                      (8, 2.0, 1.0, inf), (16, 3.0, 1.0, inf)],
             "never": [(r, 1.0, 2.0, inf) for r in rows]}
    for case, want in (("flip", 8), ("never", kernel_calibration.NEVER)):
        monkeypatch.setattr(kernel_calibration, "chain_times",
                            lambda modules, rows, reps, case=case: times[case])
        assert kernel_calibration.calibrate([], rows) == want
