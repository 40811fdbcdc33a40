"""`conveyor serve` (engine child process + gateway) and `conveyor gateway` (gateway only)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from gateway.app import SERVED, GatewayConfig, build_app
from gateway.launcher import EngineProcess, default_address
from shared.client import AsyncEngineClient
from shared.config import ATTENTION_BACKENDS, DEFAULT_MODEL, PREFILL_POLICIES
from shared.errors import EngineDead

log = logging.getLogger("gateway")

# Passed through to `python -m engine` only when given, so the engine's own defaults stay the defaults.
ENGINE_FLAGS: list[tuple[str, type, dict[str, object]]] = [
    ("--max-num-seqs", int, {"help": "sequences in one step"}),
    ("--max-num-batched-tokens", int, {"help": "token budget of one step (prefill + decode)"}),
    ("--kv-cache-memory", str, {"help": "KV cache size: bytes like 2GiB, or a fraction of free memory like 0.3"}),
    ("--block-size", int, {"help": "tokens per KV cache block (a power of two)"}),
    ("--dtype", str, {"choices": ["float32", "bfloat16", "float16"]}),
    ("--num-threads", int, {"help": "compute threads of the engine process"}),
    ("--prefill-policy", str, {"choices": list(PREFILL_POLICIES)}),
    ("--attention-backend", str, {"choices": list(ATTENTION_BACKENDS)}),
    ("--max-model-len", int, {"help": "context length; default: the model's own"}),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="An LLM inference server with an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the engine as a child process and serve HTTP")
    serve.add_argument("--model", default=DEFAULT_MODEL, help="a HF folder, a .gguf file, or the embedded default")
    serve.add_argument("--engine-address", default=None, help="connect to this engine instead of starting one")
    group = serve.add_argument_group("engine", "passed to `python -m engine`")
    for flag, typ, extra in ENGINE_FLAGS:
        group.add_argument(flag, type=typ, default=None, **extra)  # type: ignore[arg-type]
    gateway = sub.add_parser("gateway", help="serve HTTP for an engine that runs elsewhere")
    gateway.add_argument("--engine-address", required=True, help="e.g. tcp://engine:5555")
    gateway.add_argument("--model", default=None, help="where to load the tokenizer from; default: the engine's model")
    for p in (serve, gateway):
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=8000)
        p.add_argument("--served-model-name", default=None, help="the model name clients use; default: the engine's")
        p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
        p.add_argument("--max-pending", type=int, default=1024, help="requests in flight before 429")
        p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the engine's READY")
        p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser


def engine_args(args: argparse.Namespace) -> list[str]:
    out = ["--model", args.model, "--log-level", args.log_level]
    for flag, _, _ in ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


async def run(args: argparse.Namespace) -> int:
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    engine = None
    if args.engine_address is None:
        engine = EngineProcess(default_address(), engine_args(args))
        engine.start()
    client = AsyncEngineClient(engine.address if engine else args.engine_address, name="gateway", model=args.model)
    config = GatewayConfig(args.host, args.port, args.served_model_name, args.api_key, args.max_pending)
    runner, tasks = None, [asyncio.ensure_future(stop.wait())]
    try:
        if args.model is not None:  # parse the tokenizer while the engine loads its weights
            tasks.append(asyncio.create_task(client.get_tokenizer()))
        ready = asyncio.ensure_future(engine.wait_ready(client, args.ready_timeout) if engine
                                      else client.start(timeout=args.ready_timeout))
        tasks.append(ready)
        await asyncio.wait({ready, tasks[0]}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            return 130  # interrupted while the engine was loading
        ready.result()
        app = build_app(config, client)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=log if log.isEnabledFor(logging.INFO) else None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        print(f"conveyor: serving {app[SERVED].name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        if engine is not None:
            tasks.append(asyncio.create_task(engine.watch(stop)))
        await stop.wait()
        return 1 if engine and engine.exit_code() is not None else 0
    except EngineDead as e:
        print(f"conveyor: {e}", file=sys.stderr)
        return 1
    finally:
        log.info("shutting down")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if runner is not None:
            await runner.cleanup()
        log.info("http server stopped")
        await client.close()
        if engine is not None:
            await asyncio.to_thread(engine.stop)
            log.info("engine stopped")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="time=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    import uvloop

    code = uvloop.run(run(args))
    # Everything is closed and the engine is stopped by now. Skip the interpreter's teardown of the
    # modules transformers pulled in (torch among them): it takes seconds after a Ctrl-C.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
