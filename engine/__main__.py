"""`python -m engine --address ipc:///tmp/x.sock --model M ...`: the engine process."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from shared.config import ATTENTION_BACKENDS, DEFAULT_MODEL, PREFILL_POLICIES, CacheConfig, SchedulerConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags; the gateway's `conveyor serve` passes the same ones through."""
    s, c = SchedulerConfig(), CacheConfig()
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, or the embedded default")
    p.add_argument("--dtype", default="float32", help="float32 is fastest on CPUs without AMX")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--num-threads", type=int, default=None, help="compute threads; default one per core")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs,
                   help="sequences per step: more = throughput until the KV cache runs out")
    p.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens,
                   help="token budget per step: more = throughput, but longer steps (inter-token latency)")
    p.add_argument("--prefill-policy", default=s.prefill_policy, choices=PREFILL_POLICIES,
                   help="chunked: steady decode latency; prefill_first: lowest TTFT; mixed: whole prompts join decodes")
    p.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", default=c.kv_cache_memory, help="bytes ('2GiB') or fraction of free memory ('0.3')")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides --kv-cache-memory)")
    p.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace):
    from shared.config import EngineConfig

    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        num_threads=args.num_threads, max_model_len=args.max_model_len, seed=args.seed,
        scheduler=SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, args.prefill_policy),
        cache=CacheConfig(args.block_size, args.kv_cache_memory, args.num_kv_blocks),
    )


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
