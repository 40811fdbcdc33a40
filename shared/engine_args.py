"""The engine's command-line flags. In shared/ because `conveyor serve` offers the same flags and
passes them through to the engine process it starts (and the gateway must not import engine/)."""
from __future__ import annotations

import argparse

from shared.config import (
    ATTENTION_BACKENDS,
    DEFAULT_MODEL,
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    POOLING_MODES,
    PREEMPTION_MODES,
    PREFILL_POLICIES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    build_config,
)

# Flags whose value is None are left out, so the config's own defaults apply.
_NOT_CONFIG = {"address", "log_level", "model", "curve_keys", "heartbeat_interval", "trace_file"}


Parser = argparse.ArgumentParser | argparse._ArgumentGroup


def add_engine_args(p: Parser, with_model: bool = True) -> None:
    """Engine flags; `conveyor serve` offers the same ones and passes them through (engine_argv).
    Defaults are None so only what the user gave reaches the config. Help says what each trades.
    One helper per concern, called in the order --help lists them."""
    _model_args(p, with_model)
    _scheduler_args(p)
    _cache_args(p)
    _speculative_args(p)
    _parallel_args(p)
    _feature_args(p)


def _model_args(p: Parser, with_model: bool) -> None:
    """The model, its number formats, and where and how it runs."""
    a = p.add_argument
    if with_model:
        a("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, or the embedded default")
    a("--dtype", choices=DTYPES,
      help="auto (default): bfloat16 for 16-bit and quantized checkpoints on CPUs with AMX or "
           "AVX512-BF16, where it is the faster type, else float32 (bfloat16 is far slower on CPUs "
           "without them; docs/performance.md)")
    a("--quantization", choices=QUANTIZATIONS,
      help="auto (default): a GGUF's 4-bit matrices run as int4 and Q8_0 as int8 weight-only GEMMs "
           "(weights stay 4-8x smaller than float32), as w4a8 under float32 on AVX2 CPUs; none: "
           "dequantize to --dtype; w4a8: int4 weights times activations rounded to 8 bits per "
           "group of 32, as llama.cpp multiplies Q4 files (float32 on AVX2 CPUs only)")
    a("--device", help="cpu (default) or cuda")
    a("--attention-backend", choices=ATTENTION_BACKENDS,
      help="auto: Triton on CUDA, cpu elsewhere (a native kernel for decodes and short queries, "
           "PyTorch for prompts); torch: PyTorch ops only")
    a("--num-threads", type=int, help="compute threads; default: one per core")
    a("--max-model-len", type=int, help="default: the model's context length")
    a("--seed", type=int, help="seed of unseeded sampling")
    a("--deterministic", action="store_true", default=None,
      help="a request's output does not depend on the traffic: one GEMM kernel at every batch size "
           "(on AMX CPUs the quantized default already is; elsewhere it loses its int kernels at "
           "small batches; docs/determinism.md)")
    a("--enforce-eager", action="store_true", default=None,
      help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs (which "
           "cost a few seconds and some GPU memory at start); no effect on CPU")


def _scheduler_args(p: Parser) -> None:
    """SchedulerConfig: the step's budget, the prefill policy, admission and preemption."""
    a, s = p.add_argument, SchedulerConfig()
    a("--max-num-seqs", type=int,
      help=f"sequences per step (default {s.max_num_seqs}): more = throughput until the KV cache "
           "runs out")
    a("--max-num-batched-tokens", type=int,
      help=f"token budget per step (default {s.max_num_batched_tokens}): more = throughput, but "
           "longer steps (inter-token latency)")
    a("--prefill-policy", choices=PREFILL_POLICIES,
      help=f"(default {s.prefill_policy}) chunked: steady inter-token latency; prefill_first: "
           "lowest time to first token; mixed: whole prompts join decodes")
    a("--schedule-interval", type=int,
      help="admit new requests every N steps (default 1): larger = steadier decode batches, later "
           "first tokens")
    a("--waiting-served-ratio", type=float,
      help="while requests run, admit new ones only when waiting >= ratio * running (default 0 = "
           "off): bigger admission batches, later first tokens")
    a("--max-long-prefills", type=int,
      help=f"long prompts prefilling at once (default {s.max_long_prefills}): fewer = short "
           "prompts behind a long one get their first token sooner")
    a("--long-prefill-threshold", type=int,
      help="tokens that make a prompt long (default: half the budget, >= 256)")
    a("--preemption-mode", choices=PREEMPTION_MODES,
      help="(default auto) swap: copy blocks to the CPU pool; recompute: free them and prefill "
           "again; auto: swap while the CPU pool has room")


def _cache_args(p: Parser) -> None:
    """CacheConfig: the KV block pool on the device and the CPU swap pool."""
    a, c = p.add_argument, CacheConfig()
    a("--block-size", type=int, help=f"tokens per KV block (default {c.block_size})")
    a("--kv-cache-memory",
      help=f"KV pool: bytes ('2GiB') or a fraction of free memory ('0.3') (default "
      f"{c.kv_cache_memory}); with --tensor-parallel-size, the total over the ranks")
    a("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
      help="auto (default): the model's dtype; bfloat16 under a float32 model: twice the KV blocks "
           "and faster decode attention on CPU, at bfloat16's precision")
    a("--num-blocks", "--num-kv-blocks", dest="num_blocks", type=int,
      help="exact KV block count (overrides --kv-cache-memory)")
    a("--swap-space", help=f"CPU swap pool in bytes (default {c.swap_space}); 0 = recompute only; "
      "with --tensor-parallel-size, the total over the ranks")


def _speculative_args(p: Parser) -> None:
    """Speculative decoding: the proposer and how much it proposes."""
    a = p.add_argument
    a("--speculative",
      help="speculative decoding: 'auto' (prompt lookup for greedy requests on a CPU, off on a "
           "GPU), 'ngram' (prompt lookup for every request), 'draft:<model>' (a smaller model, "
           "same vocabulary) or 'none'; output unchanged, fewer steps when guesses are good "
           "(default auto)")
    a("--num-speculative-tokens", type=int,
      help="tokens proposed per sequence and step, at most (default 8)")
    a("--ngram-min", type=int, help="shortest suffix prompt lookup matches (default 2)")
    a("--ngram-max", type=int, help="longest suffix prompt lookup matches (default 4)")


def _parallel_args(p: Parser) -> None:
    """Tensor parallelism: how many ranks, where they run, how long a collective waits."""
    a = p.add_argument
    a("--tensor-parallel-size", "-tp", type=int,
      help="split the model over N ranks by attention heads and MLP units (N must divide the heads "
           "and K/V heads): 1/N of the weights and KV per rank, two all-reduces per layer per step "
           "(default 1; docs/scaling.md)")
    a("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
      help="where tensor-parallel workers run: mp (default) local processes; ray: Ray actors in a "
           "placement group, on other nodes too")
    a("--ray-address",
      help="Ray cluster to place workers on (default: the one this process is in, else a local "
           "one)")
    a("--collective-timeout", type=float,
      help="seconds a tensor-parallel collective waits for a rank before the engine fails (default "
           "60)")


def _feature_args(p: Parser) -> None:
    """What the engine offers beside generation: prefix caching, embeddings, grammars, tracing."""
    a = p.add_argument
    a("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
      help="do not reuse the KV blocks of prompt prefixes computed before (default: reuse them, "
           "which cuts time to first token for shared prefixes and costs <1%% throughput without "
           "hits)")
    a("--pooling", choices=POOLING_MODES,
      help="how /v1/embeddings pools the last hidden states: auto (default) the checkpoint's "
           "sentence-transformers Pooling module, else the last token (as vLLM does for decoders); "
           "last, mean or cls force one; none refuses embeddings (docs/api.md)")
    a("--grammar-compile-timeout", type=float, metavar="SECONDS",
      help="a structured-output grammar that takes longer to compile is refused (400) and its "
           "compile killed (default 20; real schemas take under 1 s)")
    a("--trace-file", metavar="PATH",
      help="record every step's phases and every request's lifecycle, in Chrome trace-event JSON "
           "(open it in Perfetto), and write the latest 200k events there when the engine stops "
           "(docs/dashboard.md)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    options = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG and v is not None}
    return build_config(args.model, **options)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags the user gave, back as command-line words for `python -m engine`."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser, with_model=False)
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if value is None:
            continue
        if isinstance(action, argparse._StoreFalseAction):
            argv += [action.option_strings[0]] if value is False else []
        elif isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value is True else []
        else:
            argv += [action.option_strings[0], str(value)]
    return argv
