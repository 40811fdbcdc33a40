"""The safetensors files of an HF checkpoint: which of them hold the weights, and their tensors read
one at a time, in load_order, as copies of their own. engine/load/weights.py builds models from the
stream; engine/distributed/shard.py reads the same files in the same order, cut to one rank's share.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine.load.gguf import GROUPS_FILE
from engine.models.convert import HF_NAMES

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}



def safetensors_files(folder: Path) -> list[Path]:
    """The shards the index names, else every *.safetensors except Mistral's
    consolidated.safetensors (the same weights under Mistral's own names, shipped beside the HF
    shards in some repos)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f
                for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(f for f in folder.glob("*.safetensors")
                   if not f.name.startswith("consolidated") and f.name != GROUPS_FILE)
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files (only safetensors "
                                "checkpoints are supported)")
    return files


def read_copies(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Streams tensors as fresh tensors of their own, read (not memory-mapped) from the files,
    in load_order. A memory map's pages stay resident, and counted, as long as any tensor of the
    file lives: a model that casts, packs or quantizes its matrices (all but float32 on a GPU)
    would keep the whole file's pages beside its own copies. Read, each matrix's memory goes
    when the model drops it."""
    entries = []
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            entries.append((load_order(name), name, f, 8 + size + begin, end - begin, info))
    entries.sort(key=lambda e: e[0])
    handles: dict[Path, Any] = {}
    try:
        for _, name, f, offset, nbytes, info in tqdm(entries, desc="loading weights", unit="tensor",
                                                     disable=None, leave=False):
            # SIM115: closed below, with every handle
            fh = handles.get(f) or handles.setdefault(f, open(f, "rb"))  # noqa: SIM115
            # no local keeps it while the caller holds it
            yield name, _read_tensor(fh, offset, nbytes, info)
    finally:
        for fh in handles.values():
            fh.close()


def _read_tensor(fh: Any, offset: int, nbytes: int, info: dict[str, Any]) -> torch.Tensor:
    """One tensor's bytes at offset of the open file fh, into memory of its own."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    fh.seek(offset)
    if fh.readinto(buf.numpy().data) != nbytes:
        raise ValueError(f"{fh.name} is truncated")
    return buf.view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])


def load_order(name: str) -> tuple[Any, ...]:
    """Sort key of HF names: layer by layer, the parts of each fused group next to one another (q,
    k, v; gate, up), so a streamed load never holds one group's parts while it reads another's."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        rest = ".".join(parts[3:])
        module, _, kind = rest.rpartition(".")
        ours, shard = HF_NAMES.get(module, (module, None))
        return (1, int(parts[2]), ours, kind, shard or 0, rest)
    return (0 if name.startswith("model.") else 2, name)
