"""Weight loading: HF folders (config.json + *.safetensors) and GGUF files. Never downloads
anything.

The model is built on the meta device and takes the loaded tensors as its parameters
(load_state_dict(assign=True)), so weights are allocated once. Tensors are read into memory of their
own, one at a time (not memory-mapped: engine/load/safetensors_files.py). A quantized model
(engine/load/quant.py) quantizes every projection as soon as its matrix (a fused one once its last
part arrives) is there, so it never holds more than one float32 matrix beside its codes.

A GGUF file is read by engine/load/gguf.py, which dequantizes it once into a plain HF folder in
dequantized_folder(source); every start then loads that folder like any HF model.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.kernel_choice import attach_int8_avx2, attach_packed_copies
from engine.load import int4_avx2
from engine.load.dtype import resolve_dtype
from engine.load.gguf import GROUPS_FILE, read_gguf, write_gguf_cache
from engine.load.prepack import prepack_model, usable
from engine.load.quant import LAYER_PROJECTIONS, Groups
from engine.load.quantize import quantize_matrix, quantized_targets, weight_bytes
from engine.load.safetensors_files import load_order, read_copies, safetensors_files
from engine.models import ModelConfig, get_model_class
from engine.models.convert import convert_hf_weights, iter_converted
from engine.models.llama import LlamaForCausalLM
from engine.native_stack_choice import native_stack_of
from kernels import cpu as cpu_kernels
from shared.config import INT4_QUANTIZATIONS
from shared.model_source import ModelSource

log = logging.getLogger("conveyor.weights")
# what --quantization auto serves an int4 file as under float32 where the AVX2 kernel runs
AUTO_FLOAT32_INT4 = "w4a8"
# Quantizations whose GEMMs all run one arithmetic at every row count (w4a8: the int4 matrices on
# its kernel, the int8 head on its AVX2 kernel, no copies), so the default is batch invariant
# (docs/determinism.md): the engine then puts prompt chunks on the native attention kernel too.
INVARIANT_QUANTIZATIONS = ("w4a8",)

Weights = Iterable[tuple[str, torch.Tensor]]
# our name, matrix -> its int8 rows' absmax, or None
AbsMax = Callable[[str, torch.Tensor], torch.Tensor | None]
# bump when what the dequantized folder holds changes (3: int4 groups, quantization)
_CACHE_FORMAT = 3


def load_model(source: ModelSource, dtype: torch.dtype | str, device: torch.device | str,
               quantization: str = "none", prepack: bool = True,
               deterministic: bool = False) -> tuple[nn.Module, ModelConfig]:
    """-> (model in eval mode without grads, its config; cfg.dtype is the dtype it computes in,
    cfg.quantization what its projections hold). dtype: a torch dtype, or a --dtype name ("auto"
    resolves against the checkpoint, engine/load/dtype.py). quantization: none | int8 | int4 | auto
    (engine/load/quant.py).
    prepack: float projections in oneDNN's layout on a CPU (engine/load/prepack.py); off, they stay
    nn.Linear.
    deterministic: GEMM kernels chosen so a row's result does not depend on the row count
    (docs/determinism.md).
    GGUF sources load from the dequantized cache when it exists, and create it otherwise."""
    t0 = time.perf_counter()
    device = torch.device(device)
    if source.gguf_file is None:
        folder = source.folder
    else:
        folder = dequantized_folder(source)
        gguf_path = source.folder / source.gguf_file
        if not (folder / "config.json").is_file() and not write_gguf_cache(gguf_path, folder):
            # No cache (read-only or full disk): the whole dequantized file is held once, in memory.
            config, tensors, groups = read_gguf(source.folder / source.gguf_file)
            cfg = model_config(config, None, dtype, device, quantization)
            model = build_model(cfg, _drain(tensors), device, groups, prepack, deterministic)
            _log_loaded(source, model, cfg, source.folder / source.gguf_file, t0)
            return model, cfg
    cfg = read_config(folder, dtype, device, quantization)
    groups_file = folder / GROUPS_FILE
    model = build_model(cfg, read_copies(safetensors_files(folder)), device,
                        groups_file if groups_file.is_file() else None, prepack, deterministic)
    _log_loaded(source, model, cfg, folder, t0)
    return model, cfg


def dequantized_folder(source: ModelSource) -> Path:
    """Where a GGUF source's dequantized HF folder lives. The name carries the format's
    version, so a folder an older Conveyor wrote (v1: no record of the file's precision) is
    never read as this one."""
    return source.cache_dir / f"weights-v{_CACHE_FORMAT}"


def read_config(folder: Path, dtype: torch.dtype | str, device: torch.device,
                quantization: str = "none") -> ModelConfig:
    """An HF folder's config.json (and generation_config.json), resolved as model_config does."""
    config = json.loads((folder / "config.json").read_text())
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return model_config(config, gen, dtype, device, quantization)


def model_config(config: dict[str, Any], gen: dict[str, Any] | None, dtype: torch.dtype | str,
                 device: torch.device, quantization: str = "none") -> ModelConfig:
    """The checkpoint's config with --dtype resolved (cfg.dtype: what the model computes in) and
    --quantization (cfg.quantization: what its projections hold)."""
    if isinstance(dtype, str):  # transformers v5 writes "dtype", earlier versions "torch_dtype"
        dtype = resolve_dtype(dtype, config.get("dtype") or config.get("torch_dtype"), device)
    mode = _quantization(quantization, config.get("conveyor_quantization") or "none", dtype, device)
    return dataclasses.replace(ModelConfig.from_hf(config, gen),
                               dtype=str(dtype).removeprefix("torch."), quantization=mode)


def build_model(cfg: ModelConfig, weights: Weights, device: torch.device,
                groups: dict[str, torch.Tensor] | Path | None = None, prepack: bool = True,
                deterministic: bool = False,
                make: Callable[[ModelConfig], LlamaForCausalLM] | None = None,
                absmax: AbsMax | None = None) -> nn.Module:
    """cfg (from model_config) -> the model, its weights loaded (quantized, prepacked) on device.
    weights: the HF-named tensors, each complete fused group's parts next to one another
    (load_order).
    groups: '{hf name}.scale' / '.min' tensors of GGUF Q4_0/Q4_1 matrices (exact int4 codes), or the
    safetensors file that holds them, read only for int4. prepack: plain projections in oneDNN's
    layout on a CPU (engine/load/prepack.py). make: the model class (a tensor-parallel rank's, with
    cfg its shard's config); absmax: int8 rows' absmax by our parameter name, where a rank holds
    only some columns."""
    dtype, mode = getattr(torch, cfg.dtype), cfg.quantization
    with torch.device("meta"):
        model = (make or get_model_class(cfg.architecture))(cfg)
    if mode == "none":
        cast = ((n, t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device))
                for n, t in weights)
        model.load_state_dict(model.convert_hf_weights(cast), strict=True, assign=True)
    else:
        if isinstance(groups, Path):
            groups = dict(read_copies([groups])) if mode in INT4_QUANTIZATIONS else None
        _load_quantized(model, cfg, weights, mode, dtype,
                        _our_groups(cfg, groups or {}) if mode in INT4_QUANTIZATIONS else {},
                        absmax)
        groups = None
    model = model.requires_grad_(False).eval().to(device)  # .to moves the RoPE table buffer
    native_dtype = dtype in (torch.float32, torch.bfloat16)
    if device.type == "cpu" and native_dtype and cpu_kernels.available():
        model.use_native_ops()
    if prepack and usable(model, device):
        if mode == "none":
            prepack_model(model, LAYER_PROJECTIONS, deterministic)
        else:  # the int kernels where they win, packed copies of the dequantized matrices elsewhere
            attach_packed_copies(model, dtype, deterministic=deterministic)
            attach_int8_avx2(model, dtype, deterministic or mode in INVARIANT_QUANTIZATIONS)
    if isinstance(model, LlamaForCausalLM):  # the kernels are chosen: all layers in one call?
        model.native_stack = native_stack_of(model)
    _release_freed_memory()
    return model


def _load_quantized(model: LlamaForCausalLM, cfg: ModelConfig, weights: Weights, mode: str,
                    dtype: torch.dtype, groups: Groups, absmax: AbsMax | None = None) -> None:
    """Loads the CPU model with its projections quantized as they stream in: each matrix (a fused
    one once its last part arrives) is read as float32, so its codes come from exact values,
    quantized, and dropped before the next is read. The peak is the quantized model plus about one
    float32 matrix, never the float32 model. What is not quantized (norms, biases, MoE experts)
    computes in dtype."""
    targets = quantized_targets(model, mode)  # module path -> int8 | int4
    expected = set(model.state_dict())
    modules: dict[str, nn.Module] = {}
    state: dict[str, torch.Tensor] = {}
    for name, t in iter_converted(cfg, _float32(weights)):
        path = name.removesuffix(".weight")
        if path in targets:
            peak = absmax(name, t) if absmax is not None else None
            modules[path] = quantize_matrix(t, targets[path], dtype, groups.get(name), peak)
            _on_quantized(name, t)
        else:
            state[name] = t.to(dtype) if t.is_floating_point() else t
        del t
    got = state.keys() | {f"{path}.weight" for path in modules}
    if got != expected:
        raise RuntimeError(f"checkpoint does not match {cfg.architecture}: missing "
                           f"{sorted(expected - got)}, unexpected {sorted(got - expected)}")
    for path, module in modules.items():
        bias = state.pop(f"{path}.bias", None)
        if bias is not None:
            module.bias = nn.Parameter(bias, requires_grad=False)
        model.set_submodule(path, module)
    model.load_state_dict(state, strict=False, assign=True)
    log.info("weights quantized as they loaded: %s projections, int8 embedding", mode)


def _float32(weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """Float tensors as float32. A map, not a generator: a generator's frame would keep the
    last tensor it yielded (the last part of a fused group) alive while the caller
    quantizes the fused matrix."""
    return map(_float32_item, weights)


def _float32_item(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    name, t = item
    return name, t.float() if t.is_floating_point() else t


def _on_quantized(name: str, weight: torch.Tensor) -> None:
    """Called with each float32 matrix as it is quantized, before it is dropped (tests watch what is
    alive at that moment)."""


def _release_freed_memory() -> None:
    """Hands what the load freed (float32 matrices once quantized, cast or packed) back to
    the OS. glibc keeps freed heap memory for reuse, so without this the process stays larger
    than the model it holds."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    # not glibc: the memory is reused by later allocations instead
    except (OSError, AttributeError):
        log.debug("malloc_trim unavailable; freed weight memory stays with the process")


def _quantization(asked: str, in_file: str, dtype: torch.dtype, device: torch.device) -> str:
    """--quantization -> what the projections hold. auto takes the file's (in_file, from read_gguf)
    where PyTorch's kernels are fast: on the CPU, with 16-bit activations, where they take the calls
    of few rows and packed bfloat16 copies the rest, from row counts measured on this CPU kind
    (engine/kernel_choice.py), so the quantized default is not slower than the dequantized model at
    any batch. With float32 activations torch's int kernels take a scalar path several times
    slower than a float32 GEMM (docs/performance.md), so auto then dequantizes, except an int4 file
    on a CPU with AVX2 and FMA: our AVX2 kernel (engine/load/int4_avx2.py) multiplies its codes,
    reading 4 bits a weight where the dequantized model reads 32, below packed float32 copies
    calibrated at load (engine/kernel_choice.py attach_float32_copies); there auto takes w4a8, the
    same codes times activations rounded to 8 bits: faster at every row count (no copies), at an
    accuracy cost docs/kernels.md measures. int8 / int4 named explicitly are honoured everywhere;
    w4a8 where the AVX2 kernel runs."""
    if asked != "auto":
        if asked != "none" and device.type != "cpu":
            raise ValueError(f"--quantization {asked} runs PyTorch's CPU kernels: use --device cpu "
                             "or --quantization none")
        if asked == "w4a8" and (dtype != torch.float32 or not int4_avx2.usable()):
            raise ValueError("--quantization w4a8 runs the AVX2 int4 kernel: it needs --dtype "
                             "float32 and a CPU with AVX2, FMA and F16C")
        return asked
    float32_codes = in_file == "int4" and int4_avx2.usable()
    if in_file != "none" and (device.type != "cpu" or (dtype == torch.float32
                                                       and not float32_codes)):
        log.info("--quantization auto: serving the file's %s matrices dequantized to %s (the int "
                 "kernels are fast only on the CPU with 16-bit activations, or int4 with AVX2; "
                 "--quantization %s forces them)", in_file, str(dtype).removeprefix("torch."),
                 in_file)
        return "none"
    if in_file != "none" and dtype == torch.float32:
        log.info("--quantization auto: w4a8, the file's int4 codes on the AVX2 kernel with float32 "
                 "activations rounded to 8 bits")
        return AUTO_FLOAT32_INT4
    return in_file


def _our_groups(cfg: ModelConfig,
                groups: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF-named GGUF groups -> by our fused parameter names, through the same fusion and q/k row
    permutation as the weights. A fused matrix whose parts are not all Q4_0/Q4_1 gets none."""
    parts = [{n.removesuffix(s): t for n, t in groups.items() if n.endswith(s)}
             for s in (".scale", ".min")]
    scale, low = (convert_hf_weights(cfg, p.items(), partial=True) for p in parts)
    return {name: (scale[name], low[name]) for name in scale if name in low}


def _drain(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields and removes, so each dequantized tensor is freed once the model holds its converted
    form."""
    for name in sorted(tensors, key=load_order):
        yield name, tensors.pop(name)


def _log_loaded(source: ModelSource, model: nn.Module, cfg: ModelConfig, origin: Path,
                t0: float) -> None:
    log.info("loaded %s (%.0f MiB of weights, %s, quantization %s) from %s in %.2f s", source.name,
             weight_bytes(model) / 2**20, cfg.dtype, cfg.quantization, origin,
             time.perf_counter() - t0)
