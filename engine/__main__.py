"""`python -m engine --address ipc:///tmp/x.sock --model M ...`: the engine process."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from shared.engine_args import add_engine_args, config_from_args


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine", description="Conveyor engine process")
    p.add_argument("--address", required=True, help="ZeroMQ address to bind: ipc:///path or tcp://host:port")
    p.add_argument("--log-level", default="info")
    add_engine_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    # Pin OpenMP compute threads, one per core, before torch starts them: unpinned threads migrate
    # and wait on each other at every GEMM's barrier. Set here, not below __main__, because OpenMP
    # reads them once, when torch first runs a parallel region.
    os.environ.setdefault("OMP_PROC_BIND", "close")
    os.environ.setdefault("OMP_PLACES", "cores")
    # SIGTERM unwinds like Ctrl-C so the loop closes its socket and removes its ipc file.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from engine.core import EngineCore
    from engine.loop import EngineLoop

    try:
        EngineLoop(EngineCore(config), args.address).run()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
