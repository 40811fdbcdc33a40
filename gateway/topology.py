"""The engines behind a gateway process, and their lives: one engine child (`conveyor serve`), N
data-parallel replicas each on its own cores (`serve --data-parallel-size N`), or engines that run
elsewhere (`conveyor gateway`, `serve --engine-address`). Topology starts them, waits for their
READY, supervises the children, and stops them last, after the HTTP server: the gateway exits only
once every engine child has (and so has written its --trace-file). With `serve --gateway-workers N`
it also owns the folder of the stored responses all N processes share (gateway/responses_store.py):
made at start, before any worker opens it, and removed at stop, after every worker has exited.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import shutil
import tempfile

from gateway.launcher import EngineProcess, default_address, keep_off_engine_cpus
from gateway.responses_store import ResponseStore
from gateway.router import Router, RouterConfig
from gateway.supervisor import EngineSupervisor, RestartPolicy, stop_when_all_give_up
from shared.client import AsyncEngineClient
from shared.engine_args import engine_argv

log = logging.getLogger("gateway")


def engine_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--log-level", args.log_level, *engine_argv(args)]


def replica_processes(args: argparse.Namespace, n: int) -> list[EngineProcess]:
    """n engines of `serve --data-parallel-size n`, each bound to its own share of the cores (so
    their OpenMP threads never share one), each on its own ipc:// address."""
    cpus = sorted(os.sched_getaffinity(0))
    if n > len(cpus):
        raise SystemExit(f"conveyor: --data-parallel-size {n} is more than the {len(cpus)} cores "
                         "available")
    per = len(cpus) // n
    argv = engine_args(args)
    if args.num_threads is None:
        argv += ["--num-threads", str(per)]
    base = default_address().removesuffix(".sock")
    return [EngineProcess(f"{base}-{i}.sock", argv, cpus=set(cpus[i * per:(i + 1) * per]))
            for i in range(n)]


class Topology:
    """connect (one client per engine, a router over several), start, wait_ready, supervise,
    stop."""

    def __init__(self, engines: list[EngineProcess], addresses: list[str],
                 shared_dir: str | None = None) -> None:
        # the children this process starts and stops; none for engines elsewhere
        self.engines = engines
        self.addresses = addresses
        # what serve's gateway workers share; made by start, removed by stop
        self.shared_dir = shared_dir
        self.clients: list[AsyncEngineClient] = []
        self.client: AsyncEngineClient | Router | None = None  # what the HTTP handlers talk to
        self.supervisors: list[EngineSupervisor] = []

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Topology:
        if args.command != "serve":
            return cls([], args.engine_address.split(","))
        # A name nobody can guess, so that nobody can make the folder first (os.mkdir in start fails
        # then).
        shared = (os.path.join(tempfile.gettempdir(),
                               f"conveyor-{os.getpid()}-{secrets.token_hex(8)}")
                  if args.gateway_workers > 1 else None)
        if args.engine_address is not None:
            return cls([], args.engine_address.split(","), shared)
        dp = getattr(args, "data_parallel_size", 1)
        if dp > 1:
            engines = replica_processes(args, dp)
        else:
            engines = [EngineProcess(default_address(), engine_args(args))]
        return cls(engines, [e.address for e in engines], shared)

    @property
    def responses_store(self) -> str | None:
        """The stored responses' database of serve's gateway workers; None: each gateway its own."""
        if self.shared_dir is None:
            return None
        return os.path.join(self.shared_dir, "responses.sqlite")

    def connect(self, args: argparse.Namespace) -> AsyncEngineClient | Router:
        """The clients, not started yet. ValueError: a CURVE key file is missing, a
        routing flag is wrong."""
        # serve's own engines are on ipc://, which needs no keys
        keys = None if self.engines else args.curve_keys
        self.clients = [AsyncEngineClient(a, name="gateway", model=args.model,
                                          resume_timeout=args.resume_timeout,
                                          engine_timeout=args.engine_timeout, curve_keys=keys)
                        for a in self.addresses]
        routing = RouterConfig(args.affinity_tokens, args.imbalance_tokens, policy=args.routing)
        self.client = self.clients[0] if len(self.clients) == 1 else Router(self.clients, routing)
        return self.client

    def start(self) -> None:
        if self.shared_dir is not None:
            os.mkdir(self.shared_dir, 0o700)
            # the file in WAL mode before two processes open it
            ResponseStore(0, self.responses_store).close()
        for engine in self.engines:
            engine.start()

    async def wait_ready(self, timeout: float) -> None:
        """Every engine's READY, then the router's start; an engine child that exits while loading
        fails start-up at once."""
        assert self.client is not None
        if not self.engines:
            await self.client.start(timeout=timeout)
            return
        await asyncio.gather(*(e.wait_ready(c, timeout)
                               for e, c in zip(self.engines, self.clients)))
        if isinstance(self.client, Router):
            await self.client.start(timeout=timeout)

    def keep_off_engine(self, pids: list[int]) -> None:
        """One engine child: the gateway processes `pids` move to the cores its
        threads are not bound to."""
        if len(self.engines) == 1 and self.engines[0].proc is not None:
            cpus = keep_off_engine_cpus(self.engines[0].proc.pid, pids)
            if cpus:
                log.info("gateway processes on CPUs %s, off the engine's", sorted(cpus))

    def supervise(self, stop: asyncio.Event, args: argparse.Namespace) -> asyncio.Task[None] | None:
        """Restarts each engine child that dies, on its own (the others serve meanwhile, and on
        past its give-up); sets stop once all have given up. Engines elsewhere are not this
        process's to restart."""
        if not self.engines:
            return None
        policy = RestartPolicy(max_restarts=args.max_engine_restarts,
                               ready_timeout=args.ready_timeout)
        self.supervisors = [EngineSupervisor(e, c, policy)
                            for e, c in zip(self.engines, self.clients)]
        return asyncio.create_task(stop_when_all_give_up(self.supervisors, stop))

    @property
    def gave_up(self) -> bool:
        return bool(self.supervisors) and all(s.gave_up for s in self.supervisors)

    async def stop(self) -> None:
        """The clients close, then each engine child gets one SIGTERM and is waited for (killed past
        its grace period)."""
        if self.client is not None:
            await self.client.close()
        for engine in self.engines:
            await asyncio.to_thread(engine.stop)
            log.info("engine %s stopped", engine.address)
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir, ignore_errors=True)
