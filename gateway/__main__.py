"""`conveyor serve` (engine child process + gateway workers), `conveyor gateway` (gateway only),
`conveyor ping` (is an engine up? for health checks) and `conveyor keys DIR` (CURVE keys for an
engine on TCP and its clients, shared/wire.py). This module runs the command: the gateway process,
its workers, the HTTP server, start-up and shutdown in order. The flags (and their CONVEYOR_*
environment defaults) are gateway/cli.py's; the engines behind a gateway (one child, data-parallel
replicas, or engines elsewhere) are gateway/topology.py's.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from gateway.auth import auth_of, worker_env
from gateway.cli import build_parser, gateway_config, worker_argv

if TYPE_CHECKING:  # at run time gateway modules are imported inside main(): see there
    from aiohttp import web

    from gateway.launcher import WorkerProcesses
    from gateway.router import Router
    from gateway.state import GatewayConfig
    from gateway.topology import Topology
    from shared.client import AsyncEngineClient

log = logging.getLogger("gateway")

# connections accepted by the kernel but not yet by this process (capped by somaxconn)
LISTEN_BACKLOG = 2048


def preflight(args: argparse.Namespace) -> str | None:
    """What a user can fix in a second, checked before any model loads: the trace file, the port."""
    from shared.preflight import check_port, check_writable

    trace_file = getattr(args, "trace_file", None)
    reuse = getattr(args, "reuse_port", False) or getattr(args, "gateway_workers", 1) > 1
    return (check_writable(trace_file) if trace_file
            else None) or check_port(args.host, args.port, reuse)


def worker_processes(args: argparse.Namespace, config: GatewayConfig,
                     address: str) -> WorkerProcesses | None:
    """`serve --gateway-workers N`: the N - 1 gateway processes beside this one (not started
    yet)."""
    from gateway.launcher import WorkerProcesses

    if args.command != "serve" or args.gateway_workers <= 1:
        return None
    env = {**os.environ, **worker_env(config.auth)}  # the keys not in argv: ps shows it
    argv = worker_argv(args, address, config.responses_store_path)
    return WorkerProcesses([argv for _ in range(args.gateway_workers - 1)], env)


async def http_runner(config: GatewayConfig, client: AsyncEngineClient | Router) -> web.AppRunner:
    from aiohttp import web

    from gateway.app import build_app
    from gateway.connections import ConnectionGuard, guard

    access_log = log if log.isEnabledFor(logging.INFO) else None
    runner = web.AppRunner(build_app(config, client), handler_cancellation=True,
                           access_log=access_log)
    await runner.setup()
    guard(runner, ConnectionGuard(config.header_timeout, config.max_connections))
    return runner


async def serve_http(args: argparse.Namespace, runner: web.AppRunner,
                     workers: WorkerProcesses | None, topology: Topology) -> None:
    """Binds last, so that once this process answers /ready every worker serves too."""
    from aiohttp import web

    from gateway.state import SERVED

    if workers is not None:
        await asyncio.to_thread(workers.wait_ready, args.ready_timeout)
    topology.keep_off_engine([os.getpid(), *(p.pid for p in (workers.procs if workers else []))])
    # What start-up loaded (transformers and what it imports, the tokenizer) lives until exit:
    # frozen, a full garbage collection no longer rescans it (about 0.2 s per collection, stalling
    # every stream).
    gc.freeze()
    reuse = getattr(args, "reuse_port", False) or workers is not None
    # aiohttp's default accept backlog of 128 overflows when hundreds of clients connect at once:
    # the ones over it waited about a second for a TCP retransmit before their request was even
    # read.
    await web.TCPSite(runner, args.host, args.port, reuse_port=reuse or None,
                      backlog=LISTEN_BACKLOG).start()
    if getattr(args, "ready_fd", None) is not None:
        os.write(args.ready_fd, b"ready\n")
        os.close(args.ready_fd)
    name = runner.app[SERVED].name
    print(f"conveyor: serving {name} on http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)


async def run(args: argparse.Namespace) -> int:
    """The engines start first and load while the rest starts; the HTTP server binds once
    they are ready. A signal, or every engine child giving up, stops it all in reverse
    order: the engines last."""
    from gateway.topology import Topology
    from shared.errors import EngineDead

    problem = preflight(args)
    if problem is not None:  # before any model loads
        print(f"conveyor: {problem}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    topology = Topology.from_args(args)
    try:
        client = topology.connect(args)
    except ValueError as e:  # the key folder lacks a file: say which, no traceback
        print(f"conveyor: {e}", file=sys.stderr)
        return 2
    config = gateway_config(args, topology.responses_store)
    topology.start()
    workers, runner = None, None
    tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
    try:
        workers = worker_processes(args, config, ",".join(topology.addresses))
        if workers is not None:  # they load while the engine loads
            workers.start()
        if args.model is not None:  # parse the tokenizer while the engine loads its weights
            tasks.append(asyncio.create_task(client.get_tokenizer()))
        ready = asyncio.ensure_future(topology.wait_ready(args.ready_timeout))
        tasks.append(ready)
        await asyncio.wait({ready, tasks[0]}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            return 130  # interrupted while the engine was loading
        ready.result()
        runner = await http_runner(config, client)
        await serve_http(args, runner, workers, topology)
        if workers is not None:
            tasks.append(asyncio.create_task(workers.watch(stop)))
        supervising = topology.supervise(stop, args)
        if supervising is not None:
            tasks.append(supervising)
        await stop.wait()
        return 1 if topology.gave_up or (workers and workers.failed) else 0
    except EngineDead as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 1
    finally:
        log.info("shutting down")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if workers is not None:
            await asyncio.to_thread(workers.stop)
        if runner is not None:
            await runner.cleanup()
        log.info("http server stopped")
        await topology.stop()


async def ping(args: argparse.Namespace) -> int:
    from shared.client import AsyncEngineClient
    from shared.errors import ConveyorError

    try:
        client = AsyncEngineClient(args.engine_address, name="ping", ready_timeout=args.timeout,
                                   curve_keys=args.curve_keys)
    except ValueError as e:
        print(f"conveyor ping: {e}", file=sys.stderr)
        return 1
    try:
        ready = await client.start()
        stats = await client.get_stats(timeout=args.timeout)
        print(f"engine at {args.engine_address}: {ready.model_name}, running "
              f"{stats.get('num_running', 0):g}, waiting {stats.get('num_waiting', 0):g}")
        return 0
    except ConveyorError as e:
        print(f"conveyor ping: {e}", file=sys.stderr)
        return 1
    finally:
        await client.close()


def make_keys(folder: str) -> int:
    from shared.wire import generate_keys

    try:
        engine_dir, client_dir = generate_keys(folder)
    except (ValueError, OSError) as e:
        print(f"conveyor keys: {e}", file=sys.stderr)
        return 1
    print(f"engine:  python -m engine --curve-keys {engine_dir} ...   (its secret key; the clients "
          f"it admits)\nclients: conveyor gateway --curve-keys {client_dir} ...  (a client's "
          "secret key; the engine's public key)")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "warning")
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="time=%(asctime)s level=%(levelname)s logger=%(name)s "
                               "pid=%(process)d msg=%(message)s")
    import uvloop

    if args.command == "ping":
        os._exit(uvloop.run(ping(args)))
    if args.command == "keys":
        sys.exit(make_keys(args.dir))
    if args.command == "serve" and args.gateway_workers < 1:
        sys.exit("conveyor: --gateway-workers must be >= 1")
    try:
        auth_of(args)  # a bad mix of key flags is refused before any model loads
    except ValueError as e:
        sys.exit(f"conveyor: {e}")
    metrics_dir = None
    multiproc_set = "PROMETHEUS_MULTIPROC_DIR" in os.environ
    if args.command == "serve" and args.gateway_workers > 1 and not multiproc_set:
        # Before prometheus_client is imported anywhere: it picks its value store at import time.
        metrics_dir = tempfile.mkdtemp(prefix="conveyor-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        code = uvloop.run(run(args))
    finally:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid())
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    # Everything is closed and the engine is stopped by now. Skip the interpreter's teardown of the
    # modules transformers pulled in (torch among them): it takes seconds after a Ctrl-C.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
