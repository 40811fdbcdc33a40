"""Collectives for tensor parallelism: a process group built from a TCPStore that rank 0 hosts.

No torch.distributed default group (a process-wide global): each engine holds its own group, so two
engines (a test's TP=1 reference and its TP=2 engine) live in one process. Gloo on CPU, NCCL on
CUDA. Every collective has the group's timeout: a rank that died or hangs turns into an exception on
the others (gloo notices a closed connection at once, a stuck peer after the timeout), never a hang.
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
from torch import distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed: a peer is gone or did not answer within the timeout."""


class Comm:
    """rank of world_size; rank 0 hosts the store at (host, port) and is the engine process."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 device: torch.device) -> None:
        """Rank 0 opens the store (port 0: any free port, see .port) without waiting;
        join() meets the others."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=self.timeout,
                                   wait_for_workers=False)
        # A c10d backend (ProcessGroupGloo / ProcessGroupNCCL); its allreduce/gather are not in
        # torch's stubs.
        self.pg: Any = None
        # what this rank sent into all-reduces (docs/scaling.md measures it)
        self.bytes_all_reduced = 0

    def join(self) -> None:
        """Builds the process group: returns once every rank has joined; raises CollectiveError
        after the timeout."""
        try:
            if self.device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world_size,
                                                self.timeout)
        except RuntimeError as e:
            raise CollectiveError(f"{self.world_size} tensor-parallel ranks did not all join: "
                                  f"{e}") from e

    @property
    def port(self) -> int:
        return int(self.store.port)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks, in place. -> t."""
        self.bytes_all_reduced += t.numel() * t.element_size()
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise max over the ranks, in place (at load: not counted in bytes_all_reduced).
        -> t."""
        return self._all_reduce(t, dist.ReduceOp.MAX)

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        try:
            self._pg.allreduce([t], opts).wait()
        except RuntimeError as e:
            raise CollectiveError(f"all-reduce across {self.world_size} tensor-parallel ranks "
                                  f"failed: {e}") from e
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None:
        """t: [B, C] on each rank -> on rank 0 [B, world_size * C] (rank r's columns at
        r*C); None elsewhere."""
        out = [[torch.empty_like(t) for _ in range(self.world_size)]] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        try:
            self._pg.gather(out, [t.contiguous()], opts).wait()
        except RuntimeError as e:
            raise CollectiveError(f"gathering logits from {self.world_size} tensor-parallel ranks "
                                  f"failed: {e}") from e
        return torch.cat(out[0], dim=-1) if self.rank == 0 else None

    @property
    def _pg(self) -> Any:
        assert self.pg is not None, "join() first"
        return self.pg

    def barrier(self) -> None:
        """All ranks reached this point (start-up: every shard is loaded)."""
        self.all_reduce(torch.zeros(1, device=self.device))
