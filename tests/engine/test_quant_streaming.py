"""Quantized loads stream (engine/load/weights.py): each projection is quantized as its float32
matrix arrives and dropped before the next is read, so the float32 model never exists.

Two properties: the result is the same codes and scales as quantizing the whole dequantized float32
model (quantize_model below, and the int8 / int4 formulas written out here over whole
matrices), and what is alive during the load is bounded, checked by weak references to every
tensor the loader reads, never by measuring memory."""
from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import engine.load.gguf
import engine.load.quant
import engine.load.weights
from engine.load import int4_avx2
from engine.load.gguf import read_gguf
from engine.load.quant import GROUP, Groups, Int4Linear, Int8Linear
from engine.load.quantize import quantize, quantized_targets
from engine.load.weights import _our_groups, dequantized_folder, load_model
from engine.models.llama import LlamaForCausalLM
from shared.model_source import resolve_model
from tests.conftest import save_tiny
from tests.engine.test_families import FAMILIES
from tests.engine.test_quantized import write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-gguf-stream") / "tiny-q4.gguf")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """The quantizers work CHUNK_ROWS rows at a time; at 64 the tiny model's matrices span
    several chunks."""
    monkeypatch.setattr(engine.load.quant, "CHUNK_ROWS", 64)


def quantize_model(model: LlamaForCausalLM, mode: str, dtype: torch.dtype,
                   groups: Groups | None = None) -> None:
    """Replaces the quantized_targets of a loaded float model in place: what the loader did before
    it streamed, the reference its streamed result must equal. groups: exact int4 groups of GGUF
    Q4_0/Q4_1 matrices, by our parameter name."""
    groups = groups or {}
    for path, kind in quantized_targets(model, mode).items():
        float_module = model.get_submodule(path)
        quantized = quantize(float_module, kind, dtype, groups.get(f"{path}.weight"))  # type: ignore[arg-type]
        model.set_submodule(path, quantized)


def _reference(source, mode: str, dtype: torch.dtype):
    """The float32 model quantized as a whole, after loading, as the loader did before
    it streamed."""
    plain, cfg = load_model(source, torch.float32, "cpu", "none", prepack=False)
    assert isinstance(plain, LlamaForCausalLM)  # what load_model builds, as quantize_model expects
    folder = source.folder if source.gguf_file is None else dequantized_folder(source)
    groups_file = folder / "int4_groups.safetensors"
    groups = load_file(groups_file) if groups_file.is_file() else {}
    floats = {n: t.clone() for n, t in plain.state_dict().items()}
    targets = quantized_targets(plain, mode)
    quantize_model(plain, mode, dtype, _our_groups(cfg, groups))
    for p in plain.parameters():
        p.data = p.data.to(dtype)
    return plain, floats, _our_groups(cfg, groups), targets


def _int8_by_formula(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _int4_by_formula(w: torch.Tensor, groups, avx2: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (the codes as the module holds them: torch's int4pack, or the AVX2 kernel's layout
    where avx2 (float32 activations on AVX2 CPUs), scale, zero)."""
    n, k = w.shape
    wg = w.view(n, k // GROUP, GROUP)
    if groups is None:
        lo, hi = wg.amin(dim=2), wg.amax(dim=2)
        scale, low = ((hi - lo) / 15).clamp(min=1e-12), lo
    else:
        scale, low = groups
    q = torch.round((wg - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n,
                                                                                                k)
    codes = (int4_avx2.pack_codes(q) if avx2
             else torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
    return codes, scale, low + 8 * scale


@pytest.mark.parametrize(("checkpoint", "mode", "dtype"), [
    ("gguf", "int4", torch.bfloat16), ("gguf", "int8", torch.float32),
    # untied LM head, q/k/v biases
    ("qwen2", "int4", torch.float32), ("qwen2", "int8", torch.bfloat16),
    ("phi3", "int4", torch.float32),  # q/k/v and gate/up fused in the checkpoint
    ("gemma2", "int8", torch.bfloat16),  # norms stored as 1 + w
    ("qwen3moe-top2-of-4", "int4", torch.bfloat16),  # experts stay in dtype
])
def test_streamed_quantization_equals_quantizing_the_float_model(checkpoint, mode, dtype, tiny_gguf,
                                                                 tiny_qwen2_dir, tmp_path):
    if checkpoint in FAMILIES:
        config_cls, model_cls, overrides = FAMILIES[checkpoint]
        path = save_tiny(tmp_path / checkpoint, config_cls, model_cls, **overrides)
    else:
        path = tiny_gguf if checkpoint == "gguf" else tiny_qwen2_dir
    source = resolve_model(str(path))
    model, cfg = load_model(source, dtype, "cpu", mode)
    assert cfg.quantization == mode
    ref, floats, groups, targets = _reference(source, mode, dtype)
    ours, theirs = model.state_dict(), ref.state_dict()
    # int8 matrices on the AVX2 kernel keep only its layout of their codes: compared below
    dropped = {f"{name}.qweight" for name, m in model.named_modules()
               if isinstance(m, Int8Linear) and m.qweight is None}
    assert ours.keys() == theirs.keys() - dropped
    for name, t in theirs.items():
        if name not in dropped:
            assert t.dtype == ours[name].dtype and torch.equal(ours[name], t), name
    # The codes and scales, against the formulas applied to each whole dequantized float32 matrix.
    # layers with gate_up and down (not a mixture of experts)
    dense = cfg.num_layers - len(cfg.sparse_layers)
    assert len(targets) == 2 * cfg.num_layers + 2 * dense + 1 + (not cfg.tie_word_embeddings)
    for path in targets:
        module, w = model.get_submodule(path), floats[f"{path}.weight"]
        if isinstance(module, Int4Linear):
            packed, scale, zero = _int4_by_formula(w, groups.get(f"{path}.weight"),
                                                   module.avx2_scale_low is not None)
            assert torch.equal(module.qweight, packed), path
            want = torch.stack((scale.t(), zero.t()), dim=-1).to(dtype)
            assert torch.equal(module.scales_zeros, want), path
        else:
            assert isinstance(module, Int8Linear)
            q, scale = _int8_by_formula(w)
            assert torch.equal(module.codes(), q), path
            assert torch.equal(module.scales, scale.to(dtype)), path
        bias = floats.get(f"{path}.bias")
        assert (module.bias is None) == (bias is None), path
        if bias is not None:
            assert module.bias is not None
            assert torch.equal(module.bias, bias.to(dtype)), path
    # the file's Q4_0 codes were carried over, not re-derived
    if checkpoint == "gguf" and mode == "int4":
        assert groups and all(isinstance(model.get_submodule(p.removesuffix(".weight")), Int4Linear)
                              for p in groups)


def _track(monkeypatch, module, name: str) -> list[weakref.ref]:
    """Wraps the reader module.<name> so every tensor it yields is watched through a weak reference;
    module is the one whose code looks the name up, or the wrapper is never called. The wrapper is a
    map, which (like the loader's own stages) keeps no reference to what it passed on."""
    seen: list[weakref.ref] = []
    reader = getattr(module, name)

    def watch(item):
        if not item[0].endswith((".scale", ".min")):  # int4 groups (small, kept for the whole load)
            seen.append(weakref.ref(item[1]))
        return item

    monkeypatch.setattr(module, name, lambda *args: map(watch, reader(*args)))
    return seen


def _alive(refs: list[weakref.ref]) -> list[torch.Tensor]:
    return [t for t in (r() for r in refs) if t is not None and t.is_floating_point()
            and t.dim() == 2]


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_load_holds_one_float_matrix_at_a_time(mode, tiny_gguf, tiny_qwen2_dir,
                                                         monkeypatch, tmp_path):
    # the GGUF's first load: its cache is written here
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    # looked up by engine.load.gguf._open_gguf
    dequantized = _track(monkeypatch, engine.load.gguf, "_dequantize_gguf")
    # looked up by engine.load.weights.load_model
    read = _track(monkeypatch, engine.load.weights, "read_copies")
    quantized: list[str] = []
    most_at_read = 0

    def on_quantized(name: str, weight: torch.Tensor) -> None:
        # Besides the matrix being quantized (or a tensor sharing its storage), no float matrix
        # the loader read or dequantized is alive: each earlier one, and this one's fused
        # parts, are gone.
        mine = weight.untyped_storage().data_ptr()
        others = [t for t in _alive(read + dequantized) if t.untyped_storage().data_ptr() != mine]
        assert not others, (name, [tuple(t.shape) for t in others])
        quantized.append(name)

    monkeypatch.setattr(engine.load.weights, "_on_quantized", on_quantized)
    # the loader's own name for it, as _track wrapped it
    reader = vars(engine.load.weights)["read_copies"]

    def count(item):  # while a fused group fills, its earlier parts wait: q and k while v is read
        nonlocal most_at_read
        most_at_read = max(most_at_read, len(_alive(read)))
        return item

    monkeypatch.setattr(engine.load.weights, "read_copies", lambda *args: map(count, reader(*args)))
    for path in (tiny_gguf, tiny_qwen2_dir):
        quantized.clear()
        model, cfg = load_model(resolve_model(str(path)), torch.bfloat16, "cpu", mode)
        layers = [f"model.layers.{i}.{n}.weight" for i in range(cfg.num_layers)
                  for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
        head = [] if cfg.tie_word_embeddings else ["lm_head.weight"]
        assert sorted(quantized) == sorted(["model.embed_tokens.weight", *layers, *head])
    assert len(dequantized) > 0 and len(read) > 0
    assert most_at_read <= 3  # this one, and at most two waiting parts of its fused group


def test_gguf_cache_is_written_one_tensor_at_a_time(tiny_gguf, monkeypatch, tmp_path):
    """The first load dequantizes into the cache folder with only the tensor being written alive,
    and the file holds exactly what read_gguf (the whole file in memory) returns."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    source = resolve_model(str(tiny_gguf))
    reader = engine.load.gguf._dequantize_gguf
    refs: list[weakref.ref] = []
    most = 0

    def watched(*args):
        nonlocal most
        for item in reader(*args):
            most = max(most, sum(r() is not None for r in refs))
            refs.append(weakref.ref(item[1]))
            yield item
            del item

    monkeypatch.setattr(engine.load.gguf, "_dequantize_gguf", watched)
    assert engine.load.gguf.write_gguf_cache(tiny_gguf, dequantized_folder(source))
    assert most == 0 and len(refs) > 1
    monkeypatch.setattr(engine.load.gguf, "_dequantize_gguf", reader)
    config, tensors, groups = read_gguf(tiny_gguf)
    folder = dequantized_folder(source)
    written = load_file(folder / "model.safetensors")
    assert written.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(written[name], t), name
    written_groups = load_file(folder / "int4_groups.safetensors")
    assert written_groups.keys() == groups.keys() and all(torch.equal(written_groups[n], g)
                                                          for n, g in groups.items())
