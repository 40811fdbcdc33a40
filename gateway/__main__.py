"""`conveyor serve` (engine child process + gateway workers), `conveyor gateway` (gateway only),
`conveyor ping` (is an engine up? for health checks) and `conveyor keys DIR` (CURVE keys for an engine
on TCP and its clients, shared/wire.py). This module is the command line; the engines behind a gateway
(one child, data-parallel replicas, or engines elsewhere) are gateway/topology.py's.

Every flag can also come from the environment: --max-waiting-requests from CONVEYOR_MAX_WAITING_REQUESTS,
--api-key from CONVEYOR_API_KEY, and so on (a flag on the command line wins). Containers are configured
that way, and a key in the environment does not show in `ps`.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.auth import add_auth_args, auth_of, worker_env
from shared.engine_args import add_engine_args

if TYPE_CHECKING:  # at run time gateway modules are imported inside main(): see there
    from aiohttp import web

    from gateway.launcher import WorkerProcesses
    from gateway.router import Router
    from gateway.state import GatewayConfig
    from gateway.topology import Topology
    from shared.client import AsyncEngineClient

log = logging.getLogger("gateway")

ENV_PREFIX = "CONVEYOR_"
LISTEN_BACKLOG = 2048  # connections accepted by the kernel but not yet by this process (capped by somaxconn)
# Gateway flags a worker process gets from `serve` (the API key travels in the environment instead).
WORKER_FLAGS = ("served_model_name", "max_concurrent_requests", "max_waiting_requests", "max_queued_prompt_tokens",
                "max_body_size", "max_prompt_chars", "stream_interval", "resume_timeout", "log_level",
                "curve_keys", "engine_timeout", "routing", "affinity_tokens", "imbalance_tokens",
                "chat_template", "tool_call_parser", "reasoning_parser", "responses_store_size",
                "header_timeout", "body_timeout", "max_connections", "cache_isolation")


def build_parser() -> argparse.ArgumentParser:
    from shared.config import DEFAULT_MODEL
    from shared.wire import DEFAULT_ENGINE_TIMEOUT

    parser = argparse.ArgumentParser(prog="conveyor",
                                     description="An LLM inference server with an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the engine as a child process and serve HTTP")
    serve.add_argument("--model", default=DEFAULT_MODEL, help="a HF folder, a .gguf file, or the embedded default")
    _add_serve_flags(serve)
    gateway = sub.add_parser("gateway", help="serve HTTP for an engine that runs elsewhere")
    gateway.add_argument("--engine-address", required=True,
                         help="e.g. tcp://engine:5555; several, comma-separated: replicas the gateway routes over")
    gateway.add_argument("--model", default=None, help="where to load the tokenizer from; default: the engine's model")
    gateway.add_argument("--reuse-port", action="store_true",
                         help="bind with SO_REUSEPORT (several processes, one port)")
    gateway.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)  # `serve` waits on it
    for p in (serve, gateway):
        _add_http_flags(p)
    ping = sub.add_parser("ping", help="exit 0 when the engine at an address answers the handshake (health checks)")
    ping.add_argument("--engine-address", required=True)
    ping.add_argument("--timeout", type=float, default=5.0)
    for p in (serve, gateway, ping):
        p.add_argument("--curve-keys", default=None, metavar="DIR",
                       help="for an engine on tcp:// started with --curve-keys: the DIR/client folder of "
                            "`conveyor keys DIR` (this client's key pair and the engine's public key)")
    for p in (serve, gateway):
        p.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT,
                       help="seconds of silence from the engine, with requests in flight, before they fail with "
                            "503 as if it were gone (it sends a heartbeat every second); must exceed its longest step")
    keys = sub.add_parser("keys", help="write CURVE keys: DIR/engine for `python -m engine --curve-keys`, "
                                       "DIR/client for `conveyor gateway --curve-keys` and the SDK")
    keys.add_argument("dir")
    for p in (serve, gateway, ping):
        _env_defaults(p)
    return parser


def _add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """What `serve` alone has: the engines it starts and the gateway processes beside it."""
    serve.add_argument("--engine-address", default=None,
                       help="connect to this engine instead of starting one (default: start one on "
                            "ipc:///tmp/conveyor-<pid>.sock)")
    serve.add_argument("--gateway-workers", type=int, default=1,
                       help="gateway processes sharing the port (SO_REUSEPORT), all on the one engine; each "
                            "process detokenizes and streams its own requests")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas to start, each on its own cores (--num-threads defaults to cores / N); "
                            "the gateway routes each request to one by prompt prefix, unless it is overloaded "
                            "(docs/scaling.md)")
    serve.add_argument("--max-engine-restarts", type=int, default=5,
                       help="restart an engine that dies, with backoff (0.5 s doubling to 8 s), up to this many "
                            "crashes in a row (an engine that served 60 s starts a new count); past it the "
                            "gateway exits non-zero. 0: never restart, exit when the engine does")
    group = serve.add_argument_group("engine", "passed to `python -m engine`")
    add_engine_args(group, with_model=False)


def _add_http_flags(p: argparse.ArgumentParser) -> None:
    """What `serve` and `gateway` share: the HTTP server, its limits, and routing over several engines."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients use; default: the engine's")
    add_auth_args(p)
    p.add_argument("--max-concurrent-requests", "--max-pending", dest="max_concurrent_requests", type=int,
                   default=1024, help="requests in flight in one gateway process before 429")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests without a first token yet (queued in the engine) before 429")
    p.add_argument("--max-queued-prompt-tokens", type=int, default=262144,
                   help="prompt tokens of waiting requests before 429")
    p.add_argument("--max-body-size", default="16MiB", help="largest request body (bytes, or like 1MiB) before 413")
    p.add_argument("--header-timeout", type=float, default=15.0,
                   help="seconds a connection has to send a request's headers before it is closed")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request has to send its body before a 408")
    p.add_argument("--max-connections", type=int, default=10_000,
                   help="open connections past this are closed at once (keep it below the file limit)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters of prompt text before 400, checked before tokenizing (default: "
                        "max_model_len x the longest token: more cannot fit the context)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="stream the first token at once, then one event every N tokens: fewer, larger events "
                        "(less CPU per token under load) at the price of burstier streams")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the engine's READY")
    p.add_argument("--resume-timeout", type=float, default=120.0,
                   help="seconds streams in flight wait for a lost engine to come back before they end with an "
                        "error; resumable ones carry on where they were (docs/reliability.md). 0: fail at once")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--routing", choices=("prefix", "round_robin"), default="prefix",
                   help="how requests spread over several engines: prefix (default): by the prompt's first "
                        "tokens, so shared prefixes hit one replica's cache, unless it is overloaded; "
                        "round_robin: in turn")
    p.add_argument("--affinity-tokens", type=int, default=32, metavar="N",
                   help="with several engines: the prompt's first N tokens pick its replica "
                        "(default 32)")
    p.add_argument("--imbalance-tokens", type=int, default=2048, metavar="N",
                   help="with several engines: a replica whose queued prompt tokens exceed the "
                        "least loaded one's by more than N gives the request to that one "
                        "(default 2048)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to render every chat request with, instead of the model's")
    p.add_argument("--tool-call-parser", default="auto", choices=["hermes", "llama3_json", "auto"],
                   help="how tool calls are read from the output: Hermes/Qwen <tool_call> blocks, Llama 3 JSON, "
                        "or whichever the text is")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split a reasoning model's <think>...</think> from its answer: "
                        "reasoning_content in chat completions (docs/api.md); default: none "
                        "(reasoning fields are refused)")
    p.add_argument("--responses-store-size", type=int, default=1024,
                   help="stored /v1/responses kept in memory for previous_response_id and GET (least "
                        "recently used first out); 0: none")


def _env_defaults(parser: argparse.ArgumentParser) -> None:
    """CONVEYOR_<DEST> in the environment becomes the flag's default; argparse applies the flag's type."""
    for action in parser._actions:
        value = os.environ.get(ENV_PREFIX + action.dest.upper())
        if value is None or not action.option_strings or action.dest == "help":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            action.default = value
            action.required = False


def worker_argv(args: argparse.Namespace, address: str) -> list[str]:
    argv = [sys.executable, "-m", "gateway", "gateway", "--engine-address", address, "--model", args.model,
            "--host", args.host, "--port", str(args.port), "--reuse-port"]
    for dest in WORKER_FLAGS:
        value = getattr(args, dest)
        if dest == "curve_keys" and args.engine_address is None:
            continue  # serve's own engine listens on ipc:// without keys
        if value is not None:
            argv += ["--" + dest.replace("_", "-"), str(value)]
    return argv


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    from gateway.admission import Limits
    from gateway.state import GatewayConfig
    from shared.config import parse_memory

    limits = Limits(args.max_concurrent_requests, args.max_waiting_requests, args.max_queued_prompt_tokens)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    return GatewayConfig(args.host, args.port, args.served_model_name, auth_of(args), limits,
                         parse_memory(args.max_body_size, total=1), args.stream_interval,
                         chat_template=template, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser,
                         responses_store_size=args.responses_store_size,
                         max_prompt_chars=args.max_prompt_chars, header_timeout=args.header_timeout,
                         body_timeout=args.body_timeout, max_connections=args.max_connections)


def preflight(args: argparse.Namespace) -> str | None:
    """What a user can fix in a second, checked before any model loads: the trace file, the port."""
    from shared.preflight import check_port, check_writable

    trace_file = getattr(args, "trace_file", None)
    reuse = getattr(args, "reuse_port", False) or getattr(args, "gateway_workers", 1) > 1
    return (check_writable(trace_file) if trace_file else None) or check_port(args.host, args.port, reuse)


def worker_processes(args: argparse.Namespace, config: GatewayConfig, address: str) -> WorkerProcesses | None:
    """`serve --gateway-workers N`: the N - 1 gateway processes beside this one (not started yet)."""
    from gateway.launcher import WorkerProcesses

    if args.command != "serve" or args.gateway_workers <= 1:
        return None
    env = {**os.environ, **worker_env(config.auth)}  # the keys not in argv: ps shows it
    return WorkerProcesses([worker_argv(args, address) for _ in range(args.gateway_workers - 1)], env)


async def http_runner(config: GatewayConfig, client: AsyncEngineClient | Router) -> web.AppRunner:
    from aiohttp import web

    from gateway.app import build_app
    from gateway.connections import ConnectionGuard, guard

    access_log = log if log.isEnabledFor(logging.INFO) else None
    runner = web.AppRunner(build_app(config, client), handler_cancellation=True, access_log=access_log)
    await runner.setup()
    guard(runner, ConnectionGuard(config.header_timeout, config.max_connections))
    return runner


async def serve_http(args: argparse.Namespace, runner: web.AppRunner, workers: WorkerProcesses | None,
                     topology: Topology) -> None:
    """Binds last, so that once this process answers /ready every worker serves too."""
    from aiohttp import web

    from gateway.state import SERVED

    if workers is not None:
        await asyncio.to_thread(workers.wait_ready, args.ready_timeout)
    topology.keep_off_engine([os.getpid(), *(p.pid for p in (workers.procs if workers else []))])
    # What start-up loaded (transformers and what it imports, the tokenizer) lives until exit: frozen,
    # a full garbage collection no longer rescans it (about 0.2 s per collection, stalling every stream).
    gc.freeze()
    reuse = getattr(args, "reuse_port", False) or workers is not None
    # aiohttp's default accept backlog of 128 overflows when hundreds of clients connect at once: the
    # ones over it waited about a second for a TCP retransmit before their request was even read.
    await web.TCPSite(runner, args.host, args.port, reuse_port=reuse or None, backlog=LISTEN_BACKLOG).start()
    if getattr(args, "ready_fd", None) is not None:
        os.write(args.ready_fd, b"ready\n")
        os.close(args.ready_fd)
    name = runner.app[SERVED].name
    print(f"conveyor: serving {name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> int:
    """The engines start first and load while the rest starts; the HTTP server binds once they are ready.
    A signal, or every engine child giving up, stops it all in reverse order: the engines last."""
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
    config = gateway_config(args)
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
        print(f"engine at {args.engine_address}: {ready.model_name}, running {stats.get('num_running', 0):g}, "
              f"waiting {stats.get('num_waiting', 0):g}")
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
    print(f"engine:  python -m engine --curve-keys {engine_dir} ...   (its secret key; the clients it admits)\n"
          f"clients: conveyor gateway --curve-keys {client_dir} ...  (a client's secret key; the engine's public key)")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "warning")
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="time=%(asctime)s level=%(levelname)s logger=%(name)s pid=%(process)d msg=%(message)s")
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
    if args.command == "serve" and args.gateway_workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
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
