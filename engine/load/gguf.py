"""GGUF, llama.cpp's file format: read and dequantized into Hugging Face names, config.json (from
its metadata: engine/load/gguf_config.py) and a cached safetensors folder, so engine/load/weights.py
loads a GGUF model like any HF one. Separate from weights.py because it translates another project's
format (its metadata keys, tensor names and what its converter did to each family's tensors), where
weights.py builds models from HF-named tensors.

A GGUF file is parsed and dequantized once (about 7 s for SmolLM2, most of it parsing metadata) into
a plain HF folder (config.json + model.safetensors, fp32, HF names and HF q/k row order) in
engine/load/weights.py's dequantized_folder(source), one tensor at a time; config.json's torch_dtype
says what precision the file's matrices carried, for --dtype auto. Every start, the first included,
then reads that folder like any HF model, in well under a second. The folder appears atomically
(written beside it, then renamed), so a crash or a concurrent start never leaves a half-written
cache that looks complete. Only where it cannot be written (read-only or full disk) is the whole
dequantized file held in memory (read_gguf).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.load.gguf_config import GEMMA_ARCHS, auto_mode, gguf_config, gguf_dtype
from engine.load.quant import GROUP

log = logging.getLogger("conveyor.weights")  # the cache's messages belong to the weight-loading log

_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3, gemma3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where a family's llama.cpp names mean something else or add to the above.
_GEMMA_LAYER = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_LAYER_BY_ARCH = {
    "gemma2": _GEMMA_LAYER,
    "gemma3": _GEMMA_LAYER,
    # fused as HF ships them
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # experts stacked [E, out, in]; gate and up are fused into transformers v5's gate_up_proj by
    # read_gguf
    "qwen3moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                 "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"},
}
# Phi-3 LongRoPE: read into the config
_GGUF_CONFIG_TENSORS = ("rope_factors_long", "rope_factors_short")
# fused into _FUSED_EXPERTS on reading
_EXPERT_HALVES = ("mlp.experts.gate_proj", "mlp.experts.up_proj")
_FUSED_EXPERTS = "mlp.experts.gate_up_proj"
# (HF name, fp32 tensor, its int4 groups)
GgufTensors = Iterator[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]
# exact Q4_0/Q4_1 groups: '{hf name}.scale' / '.min' [N, K/32]
GROUPS_FILE = "int4_groups.safetensors"


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor],
                                   dict[str, torch.Tensor]]:
    """-> (HF config.json dict, HF-named fp32 tensors in HF's q/k row order, the exact int4 groups
    of its Q4_0/Q4_1 matrices as '{hf name}.scale' / '.min' [N, K/32] in the same row order). Holds
    the whole dequantized model: write_gguf_cache streams the same tensors to disk instead."""
    config, _, tensors = _open_gguf(path)
    groups: dict[str, torch.Tensor] = {}
    out = {}
    for name, w, g in tensors:
        out[name] = w
        groups.update(g)
    return config, out, groups


def _open_gguf(path: Path) -> tuple[dict[str, Any], dict[str, list[int]], GgufTensors]:
    """-> (HF config.json dict, HF name -> shape of every tensor from the header alone, in the order
    the stream yields them, a stream of (HF name, fp32 tensor in HF's q/k row order, its exact int4
    groups by '{hf name}.scale' / '.min', empty unless Q4_0/Q4_1)), each dequantized only when it is
    asked for.

    Undoes what llama.cpp's converter did per family: q/k rows of "llama" permuted to its
    interleaved RoPE order (the others use NEOX, HF's order, and are stored as is); 1 added to every
    Gemma RMSNorm weight (Gemma's norm is x * (1 + w)); Qwen3-MoE's experts stacked into [E, out,
    in] tensors, whose gate and up are fused into one [E, 2I, hidden] ([gate; up] rows per expert)
    as HF v5 holds them: the fused tensor comes where the second of the two stands in the file."""
    t0 = time.perf_counter()
    reader = _checked_reader(path)
    config = gguf_config(reader)
    log.info("read GGUF metadata of %s in %.2f s", path.name, time.perf_counter() - t0)
    arch = reader.fields["general.architecture"].contents()
    shapes: dict[str, list[int]] = {}
    halves: dict[str, list[int]] = {}  # fused expert name -> the shape of the half read so far
    for t in reader.tensors:
        if t.name.rsplit(".", 1)[0] in _GGUF_CONFIG_TENSORS:
            continue
        name, module = _gguf_to_hf_name(t.name, arch)
        shape = [int(n) for n in reversed(t.shape)]
        if module in _EXPERT_HALVES:
            name = name.replace(module, _FUSED_EXPERTS)
            if name not in halves:
                halves[name] = shape
                continue
            shape = [shape[0], shape[1] + halves.pop(name)[1], *shape[2:]]
        shapes[name] = shape
    if halves:
        raise ValueError(f"GGUF expert tensors without their gate/up counterpart: {sorted(halves)}")
    config["tie_word_embeddings"] = "lm_head.weight" not in shapes
    config["torch_dtype"] = gguf_dtype({t.tensor_type for t in reader.tensors if len(t.shape) > 1})
    config["conveyor_quantization"] = auto_mode({t.tensor_type.name for t in reader.tensors
                                                 if len(t.shape) > 1})
    return config, shapes, _dequantize_gguf(reader, config, arch)


def _checked_reader(path: Path) -> Any:
    """gguf's GGUFReader, which first checks that every tensor's bytes lie inside the file: a
    truncated file names itself, the tensor and the bytes missing (gguf's own error is numpy's
    reshape message)."""
    from gguf import GGUFReader

    class Checked(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_dtype, offset = field.parts
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_dtype[0])]
                begin = int(start_offs + offset[0])
                end = begin + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise ValueError(f"{path}: truncated GGUF: tensor {bytes(name).decode()} needs "
                                     f"bytes {begin}..{end} and the file has {size}: {end - size} "
                                     "bytes missing")
            super()._build_tensors(start_offs, fields)

    return Checked(path)


def _dequantize_gguf(reader: Any, config: dict[str, Any], arch: str) -> GgufTensors:
    from gguf.quants import dequantize

    unpermute = {"self_attn.q_proj": config["num_attention_heads"],
                 "self_attn.k_proj": config["num_key_value_heads"]}
    permuted = arch == "llama"
    experts: dict[str, torch.Tensor] = {}  # the gate or up stack that waits for its other half
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", disable=None,
                  leave=False):
        if t.name.rsplit(".", 1)[0] in _GGUF_CONFIG_TENSORS:
            continue
        name, module = _gguf_to_hf_name(t.name, arch)
        a = dequantize(t.data, t.tensor_type)  # [rows, cols] float32 (GGUF lists shapes reversed)
        assert a.shape == tuple(int(n) for n in reversed(t.shape)), (t.name, a.shape, t.shape)
        if a.dtype != np.float32 or not a.flags.writeable:  # F32/F16 come as views of the file map
            a = np.array(a, dtype=np.float32)
        w = torch.from_numpy(a)
        del a
        if not bool(torch.isfinite(w).all()):  # a corrupt file: garbage served as healthy otherwise
            bad = int((~torch.isfinite(w)).sum())
            raise ValueError(f"{reader.data.filename}: tensor {t.name} holds {bad} non-finite "
                             f"values (NaN or inf) of {w.numel()}: the file is corrupt; download "
                             "it again")
        if permuted and module in unpermute:
            w = from_interleaved(w, unpermute[module])
        if arch in GEMMA_ARCHS and module.endswith(("norm", "layernorm")):
            w = w - 1
        if module in _EXPERT_HALVES:  # [E, I, hidden] each
            fused = name.replace(module, _FUSED_EXPERTS)
            other = experts.pop(fused, None)
            if other is None:
                experts[fused] = w
                continue
            gate, up = (w, other) if module == "mlp.experts.gate_proj" else (other, w)
            w, name = torch.cat((gate, up), dim=1), fused
            del gate, up, other
        groups = {}
        g = gguf_groups(t.data, t.tensor_type.name, w.shape[-1]) if w.ndim == 2 else None
        for suffix, part in zip((".scale", ".min"), g or ()):
            if permuted and module in unpermute:
                part = from_interleaved(part, unpermute[module])
            groups[name + suffix] = part
        yield name, w, groups
        del w


def from_interleaved(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: within each head, rows (2j, 2j+1) -> (j, j
    + D/2). Same as transformers' LlamaTensorProcessor._reverse_permute_weights; works
    for weights and biases."""
    d_half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, d_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_to_hf_name(name: str, arch: str) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj.weight', 'self_attn.q_proj').
    Stacked experts keep HF v5's names, which have no '.weight'."""
    base, kind = name.rsplit(".", 1)
    if base in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[base]}.{kind}", base
    parts = base.split(".")
    layer = {**_GGUF_LAYER, **_GGUF_LAYER_BY_ARCH.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        module = layer[parts[2]]
        suffix = "" if module.startswith("mlp.experts.") else f".{kind}"
        return f"model.layers.{parts[1]}.{module}{suffix}", module
    if base == "rope_freqs":
        raise ValueError("GGUF rope_freqs (Llama 3.1-style RoPE scaling stored as factors) is not "
                         "supported")
    raise ValueError(f"unexpected GGUF tensor {name!r} for architecture {arch!r}")


def write_gguf_cache(path: Path, folder: Path) -> bool:
    """Dequantizes the GGUF file into the HF folder, one tensor at a time: each is written and
    dropped before the next is dequantized (the safetensors header, written first, needs only the
    shapes, which the GGUF header has). The folder appears atomically. A failure (read-only or full
    disk) costs only speed, so it is logged, not raised: -> whether the folder is there."""
    tmp = None
    try:
        config, shapes, tensors = _open_gguf(path)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".weights-", dir=folder.parent))
        groups = _write_safetensors(tmp / "model.safetensors", shapes, tensors)
        if groups:
            save_file(groups, str(tmp / GROUPS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        # fails if a concurrent start renamed its copy first: theirs is as good
        os.rename(tmp, folder)
        log.info("dequantized %s into %s", path.name, folder)
        return True
    except OSError as e:
        if (folder / "config.json").is_file():
            return True
        log.warning("could not write the weight cache %s (%s); the next start dequantizes again",
                    folder, e)
        return False
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_safetensors(path: Path, shapes: dict[str, list[int]],
                       tensors: GgufTensors) -> dict[str, torch.Tensor]:
    """Writes the float32 tensors that stream in, in shapes' order, as one safetensors file; -> the
    groups that came with them. The layout is safetensors' own: an 8-byte header size, a JSON header
    padded to 8 bytes, then every tensor's bytes back to back."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    groups: dict[str, torch.Tensor] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        start = f.tell()
        for name, w, g in tensors:
            begin, end = header[name]["data_offsets"]
            if f.tell() - start != begin or list(w.shape) != header[name]["shape"]:
                raise ValueError(f"GGUF tensor {name!r} is out of order or not the shape its "
                                 "header says")
            f.write(w.contiguous().numpy().data)
            groups.update(g)
            del w
        if f.tell() - start != offset:
            raise ValueError(f"GGUF {path.name}: fewer tensors than its header lists")
    return groups


def gguf_groups(data: object, type_name: str, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The exact int4 groups of a GGUF Q4_0 / Q4_1 matrix: (scale, min) [N, K/32] float32 with
    w = scale * q + min, read from its blocks' fp16 headers; None for any other type.
    data: the tensor's raw bytes as gguf's reader maps them ([N, bytes per row] uint8)."""
    block = {"Q4_0": 18, "Q4_1": 20}.get(type_name)
    if block is None:
        return None
    raw = np.asarray(data, dtype=np.uint8).reshape(-1, k // GROUP, block)  # [N, K/32, block bytes]
    # [N, K/32]
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if type_name == "Q4_0":  # d * (q - 8)
        return d, -8 * d
    m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    return d, m
