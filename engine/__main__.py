"""`python -m engine --address ipc:///tmp/x.sock --model M ...`: the engine process.

--curve-keys (or CONVEYOR_CURVE_KEYS) turns on CURVE for an engine on TCP: the folder `conveyor keys
DIR` wrote as DIR/engine (shared/wire.py)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

from shared.engine_args import add_engine_args, config_from_args
from shared.preflight import check_writable
from shared.wire import HEARTBEAT_INTERVAL, load_keys


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine", description="Conveyor engine process")
    p.add_argument("--address", required=True,
                   help="ZeroMQ address to bind: ipc:///path or tcp://host:port")
    p.add_argument("--log-level", default="info")
    p.add_argument("--curve-keys", default=os.environ.get("CONVEYOR_CURVE_KEYS") or None,
                   metavar="DIR",
                   help="CURVE: encrypt the wire and admit only clients whose public key is in DIR "
                        "(the DIR/engine folder of `conveyor keys DIR`; default: "
                        "$CONVEYOR_CURVE_KEYS)")
    p.add_argument("--heartbeat-interval", type=float, default=HEARTBEAT_INTERVAL,
                   metavar="SECONDS",
                   help="a HEARTBEAT to each client with requests in flight at most this often "
                        f"(default {HEARTBEAT_INTERVAL:g}); keep it well below the clients' "
                        "--engine-timeout")
    add_engine_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    try:
        config = config_from_args(args)
        keys = load_keys(args.curve_keys, "engine") if args.curve_keys else None
        if not args.heartbeat_interval > 0:
            raise ValueError("--heartbeat-interval must be > 0")
        problem = check_writable(args.trace_file) if args.trace_file else None
        if problem is not None:  # before the model loads
            sys.exit(f"python -m engine: {problem}")
    except ValueError as e:
        p.error(str(e))
    # Pin OpenMP compute threads, one per core, before torch starts them: unpinned threads migrate
    # and wait on each other at every GEMM's barrier. Set here, not below __main__, because OpenMP
    # reads them once, when torch first runs a parallel region.
    os.environ.setdefault("OMP_PROC_BIND", "close")
    os.environ.setdefault("OMP_PLACES", "cores")
    # SIGTERM unwinds like Ctrl-C so the loop closes its socket and removes its ipc file.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        from engine.core import EngineCore
        from engine.loop import EngineLoop

        core = EngineCore(config)
    # a setting this model cannot run with (a TP size that does not divide its heads, ...)
    except ValueError as e:
        sys.exit(f"python -m engine: {e}")
    except KeyboardInterrupt:  # SIGTERM while loading
        return
    with contextlib.suppress(KeyboardInterrupt):
        EngineLoop(core, args.address, keys, args.heartbeat_interval, args.trace_file).run()


if __name__ == "__main__":
    main()
