"""The command line of `conveyor`: its subcommands and flags, their defaults from the environment,
and what the flags become (a GatewayConfig, a gateway worker's argv). gateway/__main__.py runs the
command; the engines behind a gateway are gateway/topology.py's.

Every flag can also come from the environment: --max-waiting-requests from
CONVEYOR_MAX_WAITING_REQUESTS, --api-key from CONVEYOR_API_KEY, and so on (a flag on the command
line wins). Containers are configured that way, and a key in the environment does not show in `ps`.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.auth import add_auth_args, auth_of
from shared.engine_args import add_engine_args

if TYPE_CHECKING:  # imported inside gateway_config: `conveyor ping` and `keys` need no aiohttp
    from gateway.state import GatewayConfig

ENV_PREFIX = "CONVEYOR_"
# Gateway flags a worker process gets from `serve` (the API key travels in the environment instead).
WORKER_FLAGS = ("served_model_name", "max_concurrent_requests", "max_waiting_requests",
                "max_queued_prompt_tokens", "max_body_size", "max_prompt_chars", "stream_interval",
                "resume_timeout", "log_level", "curve_keys", "engine_timeout", "routing",
                "affinity_tokens", "imbalance_tokens", "chat_template", "tool_call_parser",
                "reasoning_parser", "responses_store_size", "header_timeout", "body_timeout",
                "max_connections", "cache_isolation")


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags, each flag's default taken from the environment where set."""
    from shared.config import DEFAULT_MODEL
    from shared.wire import DEFAULT_ENGINE_TIMEOUT

    parser = argparse.ArgumentParser(prog="conveyor",
                                     description="An LLM inference server with an "
                                                 "OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the engine as a child process and serve HTTP")
    serve.add_argument("--model", default=DEFAULT_MODEL,
                       help="a HF folder, a .gguf file, or the embedded default")
    _add_serve_flags(serve)
    gateway = sub.add_parser("gateway", help="serve HTTP for an engine that runs elsewhere")
    gateway.add_argument("--engine-address", required=True,
                         help="e.g. tcp://engine:5555; several, comma-separated: replicas the "
                              "gateway routes over")
    gateway.add_argument("--model", default=None,
                         help="where to load the tokenizer from; default: the engine's model")
    gateway.add_argument("--reuse-port", action="store_true",
                         help="bind with SO_REUSEPORT (several processes, one port)")
    # `serve` waits on it
    gateway.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    # `serve --gateway-workers`: the stored responses' file its processes share
    # (gateway/topology.py)
    gateway.add_argument("--responses-store-path", default=None, help=argparse.SUPPRESS)
    for p in (serve, gateway):
        _add_http_flags(p)
    ping = sub.add_parser("ping",
                          help="exit 0 when the engine at an address answers the handshake (health "
                               "checks)")
    ping.add_argument("--engine-address", required=True)
    ping.add_argument("--timeout", type=float, default=5.0)
    for p in (serve, gateway, ping):
        p.add_argument("--curve-keys", default=None, metavar="DIR",
                       help="for an engine on tcp:// started with --curve-keys: the DIR/client "
                            "folder of `conveyor keys DIR` (this client's key pair and the "
                            "engine's public key)")
    for p in (serve, gateway):
        p.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT,
                       help="seconds of silence from the engine, with requests in flight, before "
                            "they fail with 503 as if it were gone (it sends a heartbeat every "
                            "second); must exceed its longest step")
    keys = sub.add_parser("keys",
                          help="write CURVE keys: DIR/engine for `python -m engine --curve-keys`, "
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
                       help="gateway processes sharing the port (SO_REUSEPORT), all on the one "
                            "engine; each process detokenizes and streams its own requests")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas to start, each on its own cores (--num-threads "
                            "defaults to cores / N); the gateway routes each request to one by "
                            "prompt prefix, unless it is overloaded (docs/scaling.md)")
    serve.add_argument("--max-engine-restarts", type=int, default=5,
                       help="restart an engine that dies, with backoff (0.5 s doubling to 8 s), up "
                            "to this many crashes in a row (an engine that served 60 s starts a "
                            "new count); past it the gateway exits non-zero. 0: never restart, "
                            "exit when the engine does")
    group = serve.add_argument_group("engine", "passed to `python -m engine`")
    add_engine_args(group, with_model=False)


def _add_http_flags(p: argparse.ArgumentParser) -> None:
    """What `serve` and `gateway` share: the HTTP server, its limits, and routing over several
    engines (_add_routing_flags)."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use; default: the engine's")
    add_auth_args(p)
    p.add_argument("--max-concurrent-requests", "--max-pending", dest="max_concurrent_requests",
                   type=int, default=1024,
                   help="requests in flight in one gateway process before 429")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests without a first token yet (queued in the engine) before 429")
    p.add_argument("--max-queued-prompt-tokens", type=int, default=262144,
                   help="prompt tokens of waiting requests before 429")
    p.add_argument("--max-body-size", default="16MiB",
                   help="largest request body (bytes, or like 1MiB) before 413")
    p.add_argument("--header-timeout", type=float, default=15.0,
                   help="seconds a connection has to send a request's headers before it is closed")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request has to send its body before a 408")
    p.add_argument("--max-connections", type=int, default=10_000,
                   help="open connections past this are closed at once (keep it below the file "
                        "limit)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters of prompt text before 400, checked before tokenizing (default: "
                        "max_model_len x the longest token: more cannot fit the context)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="stream the first token at once, then one event every N tokens: fewer, "
                        "larger events (less CPU per token under load) at the price of burstier "
                        "streams")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the engine's READY")
    p.add_argument("--resume-timeout", type=float, default=120.0,
                   help="seconds streams in flight wait for a lost engine to come back before they "
                        "end with an error; resumable ones carry on where they were "
                        "(docs/reliability.md). 0: fail at once")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    _add_routing_flags(p)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to render every chat request with, instead of the "
                        "model's")
    p.add_argument("--tool-call-parser", default="auto", choices=["hermes", "llama3_json", "auto"],
                   help="how tool calls are read from the output: Hermes/Qwen <tool_call> blocks, "
                        "Llama 3 JSON, or whichever the text is")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split a reasoning model's <think>...</think> from its answer: "
                        "reasoning_content in chat completions (docs/api.md); default: none "
                        "(reasoning fields are refused)")
    p.add_argument("--responses-store-size", type=int, default=1024,
                   help="stored /v1/responses kept for previous_response_id and GET (least "
                        "recently used first out; serve's gateway workers share them); 0: none")


def _add_routing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", choices=("prefix", "round_robin"), default="prefix",
                   help="how requests spread over several engines: prefix (default): by the "
                        "prompt's first tokens, so shared prefixes hit one replica's cache, unless "
                        "it is overloaded; round_robin: in turn")
    p.add_argument("--affinity-tokens", type=int, default=32, metavar="N",
                   help="with several engines: the prompt's first N tokens pick its replica "
                        "(default 32)")
    p.add_argument("--imbalance-tokens", type=int, default=2048, metavar="N",
                   help="with several engines: a replica whose queued prompt tokens exceed the "
                        "least loaded one's by more than N gives the request to that one "
                        "(default 2048)")


def _env_defaults(parser: argparse.ArgumentParser) -> None:
    """CONVEYOR_<DEST> in the environment becomes the flag's default; argparse applies the flag's
    type."""
    for action in parser._actions:
        value = os.environ.get(ENV_PREFIX + action.dest.upper())
        if value is None or not action.option_strings or action.dest == "help":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            action.default = value
            action.required = False


def worker_argv(args: argparse.Namespace, address: str,
                responses_store: str | None = None) -> list[str]:
    """The command line of one `serve --gateway-workers` process: `conveyor gateway` on serve's
    engines (and on its stored responses' file)."""
    argv = [sys.executable, "-m", "gateway", "gateway", "--engine-address", address, "--model",
            args.model, "--host", args.host, "--port", str(args.port), "--reuse-port"]
    if responses_store is not None:
        argv += ["--responses-store-path", responses_store]
    for dest in WORKER_FLAGS:
        value = getattr(args, dest)
        if dest == "curve_keys" and args.engine_address is None:
            continue  # serve's own engine listens on ipc:// without keys
        if value is not None:
            argv += ["--" + dest.replace("_", "-"), str(value)]
    return argv


def gateway_config(args: argparse.Namespace, responses_store: str | None = None) -> GatewayConfig:
    """The gateway's slice of the flags, validated once; responses_store: the file serve's gateway
    workers share (gateway/topology.py), else a worker's --responses-store-path."""
    from gateway.admission import Limits
    from gateway.state import GatewayConfig
    from shared.config import parse_memory

    limits = Limits(args.max_concurrent_requests, args.max_waiting_requests,
                    args.max_queued_prompt_tokens)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    return GatewayConfig(args.host, args.port, args.served_model_name, auth_of(args), limits,
                         parse_memory(args.max_body_size, total=1), args.stream_interval,
                         chat_template=template, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser,
                         responses_store_size=args.responses_store_size,
                         responses_store_path=responses_store
                         or getattr(args, "responses_store_path", None),
                         max_prompt_chars=args.max_prompt_chars, header_timeout=args.header_timeout,
                         body_timeout=args.body_timeout, max_connections=args.max_connections)
