"""What every tensor-parallel rank holds and does: its shard of the model, the K/V blocks of its
heads, and one step run from a StepInputs. The engine (rank 0) and each worker run this same code,
so the ranks cannot drift apart in what they compute."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.batch import Batch
from engine.distributed.comm import Comm
from engine.distributed.layers import ROW_PARALLEL, ShardedLlama
from engine.distributed.message import StepInputs
from engine.distributed.shard import Shard, read_shard
from engine.kv_cache import KVCache, available_memory
from engine.load.weights import build_model, read_config
from engine.runner import move_blocks
from kernels import get_backend
from kernels.backend import BatchLayout
from shared.config import CacheConfig, parse_memory

log = logging.getLogger("conveyor.tp")


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to start, as plain JSON (a worker's command line or a Ray
    actor's call). num_blocks and num_cpu_blocks are rank 0's, so every rank's pools
    hold the same block ids."""

    folder: str
    dtype: str
    quantization: str
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    kv_cache_dtype: str
    num_threads: int
    seed: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    step_address: str  # the engine's ZeroMQ ROUTER the worker takes its step messages from
    timeout_s: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


class RankRunner:
    """One rank's model shard and K/V pools; run(inputs) computes one step on them."""

    def __init__(self, model: ShardedLlama, kv: KVCache, comm: Comm, device: torch.device,
                 attention_backend: str) -> None:
        self.model, self.kv, self.comm, self.device = model, kv, comm, device
        self.backend = get_backend(attention_backend, device, getattr(torch, model.config.dtype))

    @torch.inference_mode()
    def run(self, s: StepInputs) -> torch.Tensor:
        """Block moves, then the forward. -> logits [B, V] on rank 0, this rank's
        vocabulary columns elsewhere."""
        move_blocks(self.backend, self.kv, s.swap_out, s.swap_in, s.copies)
        dev = self.device
        layout = BatchLayout(s.query_lens, s.context_lens, s.tables, self.kv.block_size,
                             torch.tensor(s.slots, dtype=torch.int64, device=dev))
        logits: torch.Tensor = self.model(torch.tensor(s.input_ids, dtype=torch.int64, device=dev),
                                          torch.tensor(s.positions, dtype=torch.int64, device=dev),
                                          self.kv.device, self.backend.plan(layout), self.backend,
                                          torch.tensor(s.logits_rows, dtype=torch.int64,
                                                       device=dev))
        return logits

    @torch.inference_mode()
    def run_pooling(self, s: StepInputs, batch: Batch,
                    rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's run of a step with embedding rows (s is batch's inputs): the same block moves
        and collectives as run, which the workers run, in the same order (the layers' all-reduces,
        then the logits' gather); -> (logits [B, V], the final hidden states of rows [R, E]), the
        states whole on every rank after the layers' all-reduces."""
        move_blocks(self.backend, self.kv, s.swap_out, s.swap_in, s.copies)
        return batch.forward_hidden(self.model, self.kv.device, self.backend, self.device, rows)


def load_shard(spec: RankSpec, comm: Comm) -> tuple[ShardedLlama, Shard]:
    """This rank's slice of the checkpoint, read sliced from the files and built as one engine
    builds its model (engine/load/weights.py), then its row-parallel projections wrapped. comm must
    be joined: an int8 row-parallel matrix takes its rows' absmax over every rank's columns."""
    t0 = time.perf_counter()
    device = torch.device(spec.device)
    cfg = read_config(Path(spec.folder), spec.dtype, device, spec.quantization)
    shard = Shard(cfg, spec.rank, spec.world_size)
    local = shard.local_config()

    def absmax(name: str, t: torch.Tensor) -> torch.Tensor | None:
        if name.rsplit(".", 2)[-2] not in ROW_PARALLEL:
            return None
        return comm.all_reduce_max(t.abs().amax(dim=1))

    make = functools.partial(ShardedLlama, comm=comm, vocab_start=shard.vocab_start,
                             vocab_size=cfg.vocab_size)
    model = build_model(local, read_shard(Path(spec.folder), shard), device, make=make,
                        absmax=absmax)
    assert isinstance(model, ShardedLlama)
    model.split_projections()
    log.info("rank %d/%d: %d heads, %d K/V heads, %d MLP units, vocabulary rows %d.. loaded in "
             "%.2f s", spec.rank, spec.world_size, local.num_heads, local.num_kv_heads,
             local.intermediate_size, shard.vocab_start, time.perf_counter() - t0)
    return model, shard


def per_rank_cache(cache: CacheConfig, world_size: int, device: torch.device) -> CacheConfig:
    """--kv-cache-memory and --swap-space are the engine's totals over its ranks: a rank's block
    holds 1/N of the K/V heads, so 1/N of each budget per rank gives every rank the block count (and
    the tokens) of one engine with the whole budget. A fraction of free memory is of the host's,
    which the ranks share on CPU; on CUDA the device pool's fraction is of each rank's own GPU, as
    one engine's would be."""
    if cache.num_blocks is not None and cache.num_cpu_blocks is not None:
        return cache
    host = available_memory(torch.device("cpu"))
    kv = parse_memory(cache.kv_cache_memory, total=available_memory(device))
    if not (device.type == "cuda" and parse_memory(cache.kv_cache_memory, total=1) == 0):
        kv //= world_size  # bytes (or a fraction of host memory) are the total over the ranks
    swap = parse_memory(cache.swap_space, total=host) // world_size
    return dataclasses.replace(cache, kv_cache_memory=str(max(kv, 1)), swap_space=str(swap))


def make_kv(shard: Shard, cache: CacheConfig, device: torch.device) -> KVCache:
    """The K/V pools of this rank's K/V heads: 1/N of a TP=1 engine's bytes per block."""
    local = shard.local_config()
    return KVCache(cache, local.num_layers, local.num_kv_heads, local.head_dim,
                   getattr(torch, local.dtype), device)


def worker_cache(spec: RankSpec) -> CacheConfig:
    """A worker's pools: exactly rank 0's block counts."""
    return CacheConfig(block_size=spec.block_size, num_blocks=spec.num_blocks,
                       num_cpu_blocks=spec.num_cpu_blocks, kv_cache_dtype=spec.kv_cache_dtype)
