"""TPRunner: the ModelRunner the scheduler sees under --tensor-parallel-size N (execute(plan) ->
StepOutput, unchanged), whose forward runs on N ranks: this process is rank 0 and samples; ranks
1..N-1 are workers (launch.py) that take each step's inputs as one message and join the collectives.

A rank that dies or stops answering ends the engine: the step raises EngineFault (engine/step.py)
within the collective timeout on rank 0 (the survivors' collectives fail too, and they exit); the
loop exits without answering its requests, so its clients hold them and resume them on the engine a
supervisor starts again, with all its ranks (shared/resume.py), as after a SIGKILL of the engine
itself.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import zmq

from engine.batch import Batch
from engine.distributed.comm import CollectiveError, Comm
from engine.distributed.launch import ProcessWorker, RayWorker, WorkerHandle, node_ip, ray_placement
from engine.distributed.message import StepInputs, pack, stop_message
from engine.distributed.rank import RankRunner, RankSpec, load_shard, make_kv, per_rank_cache
from engine.distributed.shard import Shard, check_divisible, check_int4, checkpoint_folder
from engine.distributed.worker import READY
from engine.load.weights import read_config
from engine.models.config import ModelConfig
from engine.runner import ModelRunner
from engine.step import EngineFault, StepPlan
from shared.config import INT4_QUANTIZATIONS, EngineConfig
from shared.model_source import ModelSource

log = logging.getLogger("conveyor.tp")
DEATH_GRACE_S = 2.0  # how long a failed collective waits for a dead worker's exit to become visible
STOP_GRACE_S = 2.0  # how long the survivors of a dead worker get to take STOP before being killed
R = TypeVar("R")  # what rank 0's part of a step returns


class TPRunner(ModelRunner):
    def __init__(self, rank0: RankRunner, workers: list[WorkerHandle], sock: zmq.Socket[bytes],
                 identities: list[bytes]) -> None:
        super().__init__(rank0.model, rank0.kv, rank0.backend, rank0.device)
        self.rank0, self.workers, self.sock, self.identities = rank0, workers, sock, identities
        self._moves: tuple[list[tuple[int, int]], ...] = ([], [], [])

    def _swap(self, plan: StepPlan) -> None:
        """Every rank moves its own heads' blocks: the moves ride in the step's message."""
        self._moves = (plan.swap_out, plan.swap_in, plan.copies)

    def _forward(self, batch: Batch) -> torch.Tensor:
        return self._on_every_rank(batch, self.rank0.run)

    def _forward_hidden(self, batch: Batch, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._on_every_rank(batch, lambda s: self.rank0.run_pooling(s, batch, rows))

    def _on_every_rank(self, batch: Batch, run: Callable[[StepInputs], R]) -> R:
        """The step's inputs to every worker, then rank 0's part of the step."""
        inputs = StepInputs.of(batch, *self._moves)
        self._broadcast(pack(inputs))
        try:
            return run(inputs)
        except CollectiveError as e:
            # A killed worker's sockets reset before its exit can be seen: give the exit a moment to
            # show, so the error names the lost rank rather than only the failed collective.
            raise EngineFault(f"{e}{self._dead(wait_s=DEATH_GRACE_S)}") from e

    def _broadcast(self, message: object) -> None:
        dead = self._dead()
        if dead:
            raise EngineFault(f"a tensor-parallel worker is gone{dead}")
        for ident in self.identities:
            self.sock.send_multipart([ident, message], copy=False)  # type: ignore[list-item]

    def _dead(self, wait_s: float = 0.0) -> str:
        """' (rank N exited)' for workers that have ended, waiting up to wait_s for one to."""
        deadline = time.monotonic() + wait_s
        while True:
            ranks = [i + 1 for i, w in enumerate(self.workers) if w.exited()]
            if ranks or time.monotonic() >= deadline:
                return f" (rank {', '.join(map(str, ranks))} exited)" if ranks else ""
            time.sleep(0.01)

    def close(self) -> None:
        """STOP to every worker (a dead one's is dropped), then wait for them, killing any that do
        not end: soon when one is dead already (the others have nothing left to do), else in 10s."""
        for ident in self.identities:
            self.sock.send_multipart([ident, stop_message()], copy=False)  # type: ignore[list-item]
        grace = STOP_GRACE_S if self._dead() else 10.0
        for w in self.workers:
            w.stop(timeout_s=grace)
        self.sock.close(linger=0)


def start_tensor_parallel(config: EngineConfig, source: ModelSource,
                          device: torch.device) -> tuple[TPRunner, ModelConfig]:
    """Starts workers 1..N-1 and builds rank 0 here. -> (the runner, the full model's config)."""
    n = config.tensor_parallel_size
    folder = checkpoint_folder(source)
    quantization = config.quantization
    cfg = read_config(folder, config.dtype, device, quantization)
    check_divisible(cfg, n)
    if cfg.quantization in INT4_QUANTIZATIONS:
        try:
            check_int4(cfg, n, source.gguf_file is not None)
        except ValueError as e:
            if quantization != "auto":
                raise
            # auto takes what every rank can hold: the matrices dequantized
            log.info("--quantization auto at tensor_parallel_size %d: dequantized (%s)", n, e)
            quantization = "none"
            cfg = read_config(folder, config.dtype, device, quantization)
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // n)
    shard0 = Shard(cfg, 0, n)
    # its block counts are every rank's
    kv = make_kv(shard0, per_rank_cache(config.cache, n, device), device)
    ray = placement = None
    host = "127.0.0.1"
    if config.distributed_executor_backend == "ray":
        resources = {"GPU": 1.0} if device.type == "cuda" else {"CPU": float(threads)}
        ray, placement = ray_placement(config.ray_address, n, resources, config.collective_timeout)
        host = node_ip(ray)
    comm = Comm(host, 0, 0, n, config.collective_timeout, device)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port(f"tcp://{host if ray is None else '*'}")

    def spec(rank: int) -> RankSpec:
        return RankSpec(str(folder), config.dtype, quantization,
                        _device(device, rank, ray is not None), config.attention_backend,
                        kv.block_size, kv.num_blocks, kv.num_cpu_blocks,
                        config.cache.kv_cache_dtype, threads, config.seed, rank, n, host, comm.port,
                        f"tcp://{host}:{port}", config.collective_timeout)

    specs = [spec(r) for r in range(1, n)]
    workers: list[WorkerHandle] = [ProcessWorker(s) if ray is None
                                   else RayWorker(ray, placement, i, s, resources)
                                   for i, s in enumerate(specs)]
    try:
        comm.join()  # before loading: an int8 shard's scales take an all-reduce (rank.load_shard)
        model, _ = load_shard(spec(0), comm)
        identities = _wait_ready(sock, workers, config.collective_timeout)
    except BaseException:
        for w in workers:
            w.stop(timeout_s=0)
        sock.close(linger=0)
        raise
    rank0 = RankRunner(model, kv, comm, device, config.attention_backend)
    log.info("tensor parallelism: %d ranks (%s), %d threads each; KV pools over all ranks: "
             "%d blocks = %d tokens (%.0f MiB), swap %.0f MiB", n,
             config.distributed_executor_backend, threads, kv.num_blocks,
             kv.num_blocks * kv.block_size, n * kv.device.nbytes / 2**20, n * kv.cpu.nbytes / 2**20)
    return TPRunner(rank0, workers, sock, identities), cfg


def _device(device: torch.device, rank: int, on_ray: bool) -> str:
    """Rank r's device: GPU r of this node for local workers; a Ray actor sees only the GPU Ray gave
    it."""
    if device.type != "cuda" or on_ray:
        return str(device)
    return f"cuda:{rank}"


def _wait_ready(sock: zmq.Socket[bytes], workers: list[WorkerHandle],
                timeout_s: float) -> list[bytes]:
    """-> the workers' identities in rank order, once each has loaded its shard. Raises EngineFault
    when one exits first, or when they are not all ready within timeout_s."""
    ready: dict[bytes, None] = {}
    deadline = time.monotonic() + timeout_s
    while len(ready) < len(workers):
        if any(w.exited() for w in workers):
            raise EngineFault("a tensor-parallel worker exited while starting (see its log above)")
        if time.monotonic() > deadline:
            raise EngineFault(f"only {len(ready)} of {len(workers)} tensor-parallel workers were "
                              f"ready within {timeout_s:g} s")
        if sock.poll(200):
            ident, body = sock.recv_multipart()
            if body == READY:
                ready[ident] = None
    return [f"rank{r}".encode() for r in range(1, len(workers) + 1)]
