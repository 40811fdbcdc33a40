"""A tensor-parallel worker (ranks 1..N-1): `python -m engine.distributed.worker --spec JSON`, or
the body of a Ray actor. It loads its shard, then runs each step the engine sends it, until STOP or
until the engine is gone (its parent process exits, or a collective fails), and then exits: a worker
never outlives its engine, and never waits forever on one that died."""
from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np
import torch
import zmq

from engine.distributed.comm import CollectiveError, Comm
from engine.distributed.message import unpack
from engine.distributed.rank import RankRunner, RankSpec, load_shard, make_kv, worker_cache

log = logging.getLogger("conveyor.tp.worker")
READY = b"ready"
_POLL_MS = 1000  # how often an idle worker checks that its engine is still there


def serve(spec: RankSpec, parent_pid: int | None = None) -> int:
    """Runs the worker until STOP (-> 0) or until the engine is gone (-> 1)."""
    torch.set_num_threads(spec.num_threads)
    torch.manual_seed(spec.seed)
    device = torch.device(spec.device)
    ctx = zmq.Context()
    ctx.linger = 0  # term() never waits on messages to a rank that is gone
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{spec.rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec.step_address)
    try:
        comm = Comm(spec.store_host, spec.store_port, spec.rank, spec.world_size, spec.timeout_s,
                    device)
        comm.join()
        model, shard = load_shard(spec, comm)
        kv = make_kv(shard, worker_cache(spec), device)
        runner = RankRunner(model, kv, comm, device, spec.attention_backend)
        sock.send(READY)
        while True:
            if not sock.poll(_POLL_MS):
                if parent_pid is not None and os.getppid() != parent_pid:
                    log.error("rank %d: the engine process is gone; exiting", spec.rank)
                    return 1
                continue
            frame = sock.recv(copy=False)
            inputs = unpack(np.frombuffer(frame.buffer, dtype=np.int64))
            if inputs is None:
                return 0
            runner.run(inputs)
    except CollectiveError as e:
        log.error("rank %d: %s; exiting", spec.rank, e)
        return 1
    finally:
        sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.distributed.worker")
    p.add_argument("--spec", required=True, help="RankSpec as JSON")
    p.add_argument("--parent-pid", type=int, help="exit when this process (the engine) is gone")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    sys.exit(serve(RankSpec.from_json(args.spec), args.parent_pid))


if __name__ == "__main__":
    main()
