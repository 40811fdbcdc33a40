"""Which part of each checkpoint tensor a tensor-parallel rank holds, and loading just that part.

Megatron's split of a Llama layer: q/k/v and gate/up are column-parallel (rank r holds output rows
of heads r*H/N.. and of intermediate units r*I/N..), o_proj and down_proj row-parallel (the matching
input columns), so attention and the MLP need no communication until o_proj / down_proj, each
followed by one all-reduce (layers.py). The embedding and the LM head are split by vocabulary (rank
r holds rows r*Vs.. of ceil(V/N) = Vs, the last shard zero-padded). Norms are replicated.

Slices are read with safetensors' get_slice, so a rank reads its rows and columns from the file and
never holds another rank's weights, nor the whole model. The rank's model is then built, quantized
and prepacked by engine/load/weights.py's build_model, as one engine's is.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.load.gguf import write_gguf_cache
from engine.load.quant import GROUP
from engine.load.safetensors_files import load_order, safetensors_files
from engine.load.weights import dequantized_folder
from engine.models.config import ModelConfig
from shared.model_source import ModelSource


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world_size`, for a model with this (full) config."""

    cfg: ModelConfig
    rank: int
    world_size: int

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.cfg.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self) -> ModelConfig:
        """The config of this rank's part: 1/N of the heads, K/V heads, MLP units and vocabulary
        rows."""
        n, c = self.world_size, self.cfg
        return dataclasses.replace(c, num_heads=c.num_heads // n, num_kv_heads=c.num_kv_heads // n,
                                   intermediate_size=c.intermediate_size // n,
                                   vocab_size=self.vocab_per_rank)

    def rows_and_cols(self, name: str) -> tuple[list[slice], slice | None] | None:
        """HF tensor name -> (the row ranges this rank reads, concatenated; its columns, or None for
        all); None: the whole tensor (replicated)."""
        c, r, n = self.cfg, self.rank, self.world_size
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        module = ".".join(name.rsplit(".", 1)[0].rsplit(".", 2)[-2:])
        # column-parallel: (offset, rows) of each part of the tensor's output rows, of which the
        # rank takes 1/N
        parts = {"self_attn.q_proj": [(0, q)], "self_attn.k_proj": [(0, kv)],
                 "self_attn.v_proj": [(0, kv)],
                 # Phi-3: fused in the checkpoint
                 "self_attn.qkv_proj": [(0, q), (q, kv), (q + kv, kv)],
                 "mlp.gate_proj": [(0, inter)], "mlp.up_proj": [(0, inter)],
                 "mlp.gate_up_proj": [(0, inter), (inter, inter)]}  # Phi-3
        if module in parts:  # weight and bias alike
            return [slice(o + r * size // n, o + (r + 1) * size // n)
                    for o, size in parts[module]], None
        if module in ("self_attn.o_proj", "mlp.down_proj"):
            if name.endswith(".bias"):  # whole; added once: read_shard zeroes it on ranks 1..N-1
                return None
            w = (q if module == "self_attn.o_proj" else inter) // n
            return [slice(None)], slice(r * w, (r + 1) * w)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return [slice(self.vocab_start, self.vocab_start + self.vocab_per_rank)], None
        return None


def check_divisible(cfg: ModelConfig, n: int) -> None:
    """Raises ValueError unless the model splits evenly over n ranks, and its weights are ones
    shard.py can split: not mixtures of experts, whose experts are not split."""
    if n < 1:
        raise ValueError("tensor_parallel_size must be >= 1")
    if n > 1 and cfg.num_experts:
        raise ValueError(f"{cfg.architecture} needs experts, which tensor parallelism does not "
                         "split: use --tensor-parallel-size 1")
    bad = [f"{what} ({count})" for what, count in (("attention heads", cfg.num_heads),
                                                  ("key/value heads", cfg.num_kv_heads),
                                                  ("MLP intermediate size", cfg.intermediate_size))
           if count % n]
    if bad:
        splits = [d for d in range(1, cfg.num_kv_heads + 1) if cfg.num_kv_heads % d == 0
                  and cfg.num_heads % d == 0 and cfg.intermediate_size % d == 0]
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's {', '.join(bad)}; "
                         f"sizes that do: {', '.join(map(str, splits))}")


def check_int4(cfg: ModelConfig, n: int, gguf: bool) -> None:
    """Raises ValueError unless every rank's int4 matrices are slices of one engine's. A group is 32
    columns of a row: a row-parallel rank (o_proj, down_proj) holds whole groups only where its
    columns split at a multiple of 32 (where the whole matrix's do not, one engine falls back to
    int8 as every rank does). A GGUF's exact Q4 groups (engine/load/gguf.py) are not sliced: the
    ranks read its dequantized cache, whose values they would quantize again."""
    if gguf:
        raise ValueError(f"--quantization {cfg.quantization} of a GGUF is not sharded (its Q4 "
                         "groups are not sliced): use --quantization int8 or none, or "
                         "--tensor-parallel-size 1")
    columns = {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": cfg.intermediate_size}
    bad = [f"{name} ({k // n} columns a rank)" for name, k in columns.items()
           if k % GROUP == 0 and k // n % GROUP]
    if bad:
        raise ValueError(f"--quantization {cfg.quantization} is not sharded at "
                         f"tensor_parallel_size {n}: a "
                         f"rank's groups of {GROUP} columns would not be one engine's in "
                         f"{', '.join(bad)}; use --quantization int8 or none")


def checkpoint_folder(source: ModelSource) -> Path:
    """The safetensors folder to slice: the HF folder, or a GGUF file's dequantized cache.
    Writing that cache streams one tensor at a time (engine/load/gguf.py), so no process
    holds the whole model."""
    if source.gguf_file is None:
        return source.folder
    folder = dequantized_folder(source)
    cached = (folder / "config.json").is_file()
    if not cached and not write_gguf_cache(source.folder / source.gguf_file, folder):
        raise ValueError("tensor parallelism reads safetensors, and the dequantized cache "
                         f"{folder} of {source.gguf_file} could not be written")
    return folder


def read_shard(folder: Path, shard: Shard) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in load_order (per file), each cut to this rank's rows/columns as
    it is read. A row-parallel bias is rank 0's alone: the others hold zeros, so the
    all-reduce adds it once."""
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as h:
            for name in sorted(h.keys(), key=load_order):
                cut = shard.rows_and_cols(name)
                if cut is None:
                    t = h.get_tensor(name)
                    yield name, t.zero_() if shard.rank and _row_parallel_bias(name) else t
                    continue
                ranges, cols = cut
                stored = h.get_slice(name)
                parts = [stored[rows] if cols is None else stored[rows, cols] for rows in ranges]
                t = parts[0] if len(parts) == 1 else torch.cat(parts)
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    # the last rank's rows past the vocabulary
                    pad = shard.vocab_per_rank - t.shape[0]
                    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
                yield name, t


def _row_parallel_bias(name: str) -> bool:
    return name.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias"))
