"""An engine's parts, built once from its config: the model (in this process or over tensor-parallel
ranks), its KV cache, the attention backend, the proposer, the block manager, and the limits a
request is checked against. Every part that caps the context is asked here, in `max_model_len`, so
that the longest sequence the engine runs is decided in one place. EngineCore (engine/core.py) only
runs steps.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from engine import pooling
from engine.admission import Limits
from engine.block_manager import BlockManager
from engine.kv_cache import KVCache
from engine.load.weights import INVARIANT_QUANTIZATIONS, load_model
from engine.models import ModelConfig
from engine.runner import ModelRunner
from engine.speculative import Proposer, make_proposer
from kernels import get_backend, one_attention_kernel
from kernels.backend import AttentionBackend, backend_limit
from shared.config import EngineConfig
from shared.embedding import PoolingInfo
from shared.model_source import ModelSource, resolve_model

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphs
    from engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class EngineParts:
    """What EngineCore runs on; each part checked against the others."""

    source: ModelSource
    model_config: ModelConfig
    runner: ModelRunner
    proposer: Proposer | None
    block_manager: BlockManager
    max_model_len: int
    limits: Limits
    pooling: PoolingInfo


def release_window(layer_windows: tuple[int | None, ...], backend_windows: bool,
                   draft_model: bool) -> int | None:
    """The window past which a sequence's blocks may be released, or None to keep every block: when
    a layer is global (Gemma's alternating layers) it reads the whole context; a backend without
    windows caps the context at the smallest window, so nothing would ever fall out; a draft model
    reads the target's block table on its own cache and catches up from any position (after a
    preemption, from 0)."""
    if (not layer_windows or any(w is None for w in layer_windows) or not backend_windows
            or draft_model):
        return None
    return max(w for w in layer_windows if w is not None)


def build(config: EngineConfig) -> EngineParts:
    """Raises ValueError for a combination of flags that cannot run, naming the flag to change."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    device = torch.device(config.device)
    source = resolve_model(config.model)
    tp_runner, model, kv, mc = _load(config, source, device)
    dtype = getattr(torch, mc.dtype)  # --dtype auto resolved against the checkpoint and the CPU
    backend = _backend(config, kv, dtype, device, mc.quantization in INVARIANT_QUANTIZATIONS)
    proposer = make_proposer(config.speculative, mc, kv.num_blocks, config.cache, dtype, device,
                             backend)
    draft_len = proposer.max_model_len if proposer is not None else None
    window = release_window(mc.layer_windows, backend.supports_window, draft_model=bool(draft_len))
    bm = BlockManager(kv.num_blocks, kv.block_size, None, kv.num_cpu_blocks,
                      config.cache.enable_prefix_caching, window)
    live = bm.max_live_blocks(config.scheduler.max_num_batched_tokens)
    max_len = max_model_len(config, mc, backend, draft_len, bm, live)
    # drafts are proposed on rank 0 alone; verification is in the sharded forward
    if tp_runner is not None:
        tp_runner.proposer = proposer
    runner = tp_runner or ModelRunner(model, kv, backend, device, proposer)
    pool = pooling.resolve(source.folder, mc.hidden_size, config.pooling)
    runner.pool_mode = pool.mode
    if tp_runner is None and device.type == "cuda" and not config.enforce_eager:
        runner.graphs = capture_decode_graphs(runner, config.scheduler.max_num_seqs, max_len)
    limits = Limits(mc.vocab_size, max_len, config.scheduler.max_num_seqs, bm.num_blocks,
                    bm.block_size, live)
    return EngineParts(source, mc, runner, proposer, bm, max_len, limits, pool)


def max_model_len(config: EngineConfig, mc: ModelConfig, backend: AttentionBackend,
                  draft_len: int | None, bm: BlockManager, live_blocks: int | None) -> int:
    """The longest sequence (prompt and output) the engine runs: the least that each part allows.
    live_blocks: the most blocks one sequence holds (None: its whole context)."""
    limits = [
        config.max_model_len or mc.max_position_embeddings,  # --max-model-len, when given
        mc.max_position_embeddings,  # the model was trained (and its rotary scaled) no further
        backend_limit(mc, backend),  # the attention backend serves it exactly up to here
    ]
    if draft_len:  # a draft model reads the whole sequence too: its context caps it
        limits.append(draft_len)
    # A request must always fit the pool alone, or preemption could never make room for it: its
    # whole context, or with released windows its window and one step's tokens.
    if live_blocks is None or live_blocks > bm.num_blocks:
        limits.append(bm.num_blocks * bm.block_size)
    return min(limits)


def _load(config: EngineConfig, source: ModelSource,
          device: torch.device) -> tuple[ModelRunner | None, torch.nn.Module, KVCache, ModelConfig]:
    """-> (a tensor-parallel runner or None, the model, its KV cache, its config). Under tensor
    parallelism the runner holds rank 0's shard and cache; the workers hold the rest."""
    if config.tensor_parallel_size > 1:
        # workers only under --tensor-parallel-size
        from engine.distributed.executor import start_tensor_parallel

        tp_runner, mc = start_tensor_parallel(config, source, device)
        return tp_runner, tp_runner.model, tp_runner.kv_cache, mc
    model, mc = load_model(source, config.dtype, device, config.quantization,
                           deterministic=config.deterministic)
    kv = KVCache(config.cache, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                 getattr(torch, mc.dtype), device)
    return None, model, kv, mc


def _backend(config: EngineConfig, kv: KVCache, dtype: torch.dtype, device: torch.device,
             invariant_gemms: bool = False) -> AttentionBackend:
    """The attention backend, refused where it cannot serve what the flags ask of it.
    invariant_gemms: the model's GEMMs are batch invariant without --deterministic (w4a8), so
    prompt chunks take the native kernel too, as under the flag: one attention arithmetic for
    every row (on the AVX2 EPYC it cost nothing measurable: docs/determinism.md)."""
    backend = get_backend(config.attention_backend, device, dtype,
                          config.deterministic or invariant_gemms)
    if config.deterministic and not one_attention_kernel(backend):
        raise ValueError("--deterministic needs one attention kernel for prompt and decode rows: "
                         "the native CPU kernel (--attention-backend cpu, and a C++ compiler at "
                         "the first start)")
    if kv.device.dtype != dtype and not backend.casts_kv:
        model_dtype = str(dtype).removeprefix("torch.")
        raise ValueError(f"kv_cache_dtype {config.cache.kv_cache_dtype} differs from the model's "
                         f"{model_dtype}: only the cpu and torch attention backends cast between "
                         "them (--attention-backend cpu)")
    return backend


def capture_decode_graphs(runner: ModelRunner, max_batch: int, max_len: int,
                          capture: bool = True) -> DecodeGraphs | None:
    """Decode graphs for a runner on the Triton backend (the torch backend's plan is built on the
    host each step, which a graph cannot replay). capture=False: the same static buffers run
    eagerly (what the CPU tests use)."""
    from engine.cuda_graphs import DecodeGraphs
    from kernels.triton_backend import TritonBackend

    if not isinstance(runner.backend, TritonBackend):
        return None
    model = cast("LlamaForCausalLM", runner.model)
    graphs = DecodeGraphs(model, runner.kv_cache.device, runner.backend, max_batch, max_len,
                          runner.block_size, capture)
    if capture:
        with torch.inference_mode():
            graphs.capture_all()
    return graphs
