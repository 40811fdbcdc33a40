"""Starting tensor-parallel workers: local processes (mp) or Ray actors in a placement group (ray).

Either way a worker runs worker.serve(spec); what differs is where it runs and how the engine learns
that it died (a process's exit code; a Ray task that finished). Ray is imported only here, only
when asked for: it is a large package few deployments need.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

from engine.distributed.rank import RankSpec


class WorkerHandle(Protocol):
    """One started worker, as the engine watches it."""

    def exited(self) -> bool:
        """True once the worker has ended, for whatever reason."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Waits up to timeout_s for the worker to end on its own (after STOP), then kills it."""
        ...


def worker_env(spec: RankSpec) -> dict[str, str]:
    """A worker's environment: its thread count, and the engine's own code first on the path, so a
    worker runs exactly the code of the engine that started it (on another node, the same path must
    hold the same version: docs/scaling.md)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"OMP_NUM_THREADS": str(spec.num_threads), "PYTHONPATH": path}


class ProcessWorker:
    """A worker as a child process of the engine (`python -m engine.distributed.worker`)."""

    def __init__(self, spec: RankSpec) -> None:
        env = {**os.environ, **worker_env(spec)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.distributed.worker", "--spec", spec.to_json(),
             "--parent-pid", str(os.getpid())], env=env)
        self.pid = self.proc.pid

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stop(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RayWorker:
    """A worker as a Ray actor in bundle `bundle` of the engine's placement group."""

    def __init__(self, ray: Any, placement_group: Any, bundle: int, spec: RankSpec,
                 resources: dict[str, float]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                    placement_group_bundle_index=bundle)
        actor_cls = ray.remote(_RayWorkerActor)
        self.ray = ray
        self.actor = actor_cls.options(scheduling_strategy=strategy,
                                       num_cpus=resources.get("CPU", 0),
                                       num_gpus=resources.get("GPU", 0),
                                       runtime_env={"env_vars": worker_env(spec)}).remote()
        self.done = self.actor.serve.remote(spec.to_json())

    def exited(self) -> bool:
        ready, _ = self.ray.wait([self.done], timeout=0)
        return bool(ready)

    def stop(self, timeout_s: float) -> None:
        ready, _ = self.ray.wait([self.done], timeout=timeout_s)
        if not ready:
            self.ray.kill(self.actor)


class _RayWorkerActor:
    """The actor's class: one method, which is the worker's whole life."""

    def serve(self, spec_json: str) -> int:
        import logging

        from engine.distributed.worker import serve

        logging.basicConfig(level="INFO")
        return serve(RankSpec.from_json(spec_json))


def ray_placement(address: str | None, world_size: int, resources: dict[str, float],
                  timeout_s: float) -> tuple[Any, Any]:
    """Connects to the Ray cluster at address (None: start a local one, or join the one this process
    is in), and reserves one bundle per worker. -> (the ray module, the placement group)."""
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install ray") from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
    from ray.util.placement_group import placement_group

    pg = placement_group([dict(resources) for _ in range(world_size - 1)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise ValueError(f"the Ray cluster at {address or 'local'} has no room for "
                         f"{world_size - 1} workers of {resources} within {timeout_s:g} s")
    return ray, pg


def node_ip(ray: Any) -> str:
    """This node's address as the other Ray nodes reach it."""
    return str(ray.util.get_node_ip_address())
