"""Configuration: frozen dataclasses, one per concern, validated once in __post_init__.

Components receive the slice they need, never the whole EngineConfig.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

PREFILL_POLICIES = ("chunked", "prefill_first", "mixed")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w4a8")
# int4 weights in groups of 32; w4a8 also rounds the activations to 8 bits per group of 32
INT4_QUANTIZATIONS = ("int4", "w4a8")
PREEMPTION_MODES = ("auto", "swap", "recompute")
POOLING_MODES = ("auto", "last", "mean", "cls", "none")  # how embeddings pool (engine/pooling.py)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def _require(ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(why)


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class SchedulerConfig:
    """Each knob says what it trades: throughput, inter-token latency (ITL), time to first token
    (TTFT)."""

    # Tokens computed in one step, prefill and decode together. Larger = better throughput (bigger
    # GEMMs), worse ITL for running requests while prompts prefill.
    max_num_batched_tokens: int = 512
    # Sequences in one step. Larger = more throughput until the KV cache runs out (then preemption).
    max_num_seqs: int = 128
    # chunked: prompt chunks share the step with decodes (steady ITL, TTFT grows with load);
    # prefill_first: new prompts get a step of their own (lowest TTFT, decodes stall);
    # mixed: whole prompts join the decode step (simple; a long prompt stalls every decode once).
    prefill_policy: str = "chunked"
    # Admit new requests only every N steps: fewer batch changes (steadier ITL), worse TTFT.
    schedule_interval: int = 1
    # TGI's knob: while requests run, admit new ones only when waiting >= ratio * running (0 = off).
    # Larger = bigger admission batches (throughput), worse TTFT.
    waiting_served_ratio: float = 0.0
    # At most this many prompts with more than long_prefill_threshold tokens left prefill at once,
    # so one huge prompt cannot starve the first token of the short ones queued behind it. None:
    # half the step's budget, at least 256 (a prompt that fits half a step is not long: with a
    # 2,048-token budget, 1,024 gave a burst of 512-token prompts 0.65x the TTFT of 256, at the same
    # throughput).
    max_long_prefills: int = 1
    long_prefill_threshold: int | None = None
    # auto: swap to the CPU pool while it has room, else recompute; swap: CPU pool only (recompute
    # when full); recompute: free the blocks and prefill again (costs FLOPs, no memory).
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(self.prefill_policy in PREFILL_POLICIES,
                 f"prefill_policy must be one of {PREFILL_POLICIES}")
        _require(self.schedule_interval >= 1, "schedule_interval must be >= 1")
        _require(self.waiting_served_ratio >= 0, "waiting_served_ratio must be >= 0")
        _require(self.max_long_prefills >= 1, "max_long_prefills must be >= 1")
        _require(self.long_prefill_threshold is None or self.long_prefill_threshold >= 1,
                 "long_prefill_threshold must be >= 1")
        _require(self.preemption_mode in PREEMPTION_MODES,
                 f"preemption_mode must be one of {PREEMPTION_MODES}")

    @cached_property  # read for every running sequence every step
    def long_prompt_tokens(self) -> int:
        """Tokens left that make a prompt long (long_prefill_threshold, or its default)."""
        if self.long_prefill_threshold is not None:
            return self.long_prefill_threshold
        return max(256, self.max_num_batched_tokens // 2)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for the device KV pool ("2GiB", "512MiB", a plain number of bytes), or a
    # fraction of free memory ("0.3"). Ignored when num_blocks is given.
    kv_cache_memory: str = "2GiB"
    num_blocks: int | None = None
    # CPU pool that preempted requests swap to (bytes, as kv_cache_memory). 0 = recompute only.
    swap_space: str = "1GiB"
    num_cpu_blocks: int | None = None
    # Reuse the KV blocks of prompt prefixes computed before (and keep freed ones until evicted,
    # least recently used first, then in the CPU pool): much lower time to first token for shared
    # prefixes, under 1% throughput cost without hits.
    enable_prefix_caching: bool = True
    # What K/V are stored in: auto = the model's dtype. bfloat16 under a float32 model halves the
    # pool's bytes per token (twice the blocks) and the bytes decode attention reads, at bfloat16's
    # precision for attention (docs/performance.md); only the torch attention backend casts between
    # the two.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}")
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 "block_size must be a power of two")
        _require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks must be >= 1")
        parse_memory(self.kv_cache_memory, total=1)  # raises ValueError when malformed
        parse_memory(self.swap_space, total=1)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens, the model verifies them in one
    step.

    Output is unchanged (greedy: identical; sampled: the same distribution, by rejection sampling);
    what it trades is extra tokens per step (budget, FLOPs) for fewer steps per output token, which
    pays when steps are bound by reading the weights (small batches) and the guesses are good.
    """

    # "auto" (the default): prompt lookup for greedy requests on a CPU, nothing elsewhere
    # (unmeasured on GPUs, whose decode steps run as CUDA graphs); "none" (or None): off; "ngram":
    # prompt lookup for every request that may speculate (match the context's last n tokens earlier
    # in it, propose what followed; free, good for edits, summaries, code and text that repeats
    # itself); "draft:<model>": a smaller model with the same vocabulary (HF folder or .gguf) runs
    # on its own paged cache. Each sequence drafts as many tokens as its recent drafts earned
    # (engine/speculative/window.py), so a sequence whose guesses fail soon stops paying for them.
    speculative: str | None = "auto"
    # Tokens proposed per sequence and step, at most: more = longer accepted runs on easy text; a
    # sequence's window only grows to it while every draft holds.
    num_speculative_tokens: int = 8
    # Prompt lookup tries the longest suffix first, down to ngram_min tokens (one-token matches are
    # mostly wrong guesses).
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        s = self.speculative
        _require(s is None or s in ("auto", "none", "ngram")
                 or (s.startswith("draft:") and len(s) > 6),
                 "speculative must be 'auto', 'none', 'ngram' or 'draft:<model>'")
        _require(1 <= self.num_speculative_tokens <= 16,
                 "num_speculative_tokens must be in [1, 16]")
        _require(1 <= self.ngram_min <= self.ngram_max, "need 1 <= ngram_min <= ngram_max")

    @property
    def method(self) -> str | None:
        s = self.speculative
        return None if s is None or s == "none" else s.split(":", 1)[0]

    @property
    def draft_model(self) -> str | None:
        s = self.speculative
        return s[len("draft:"):] if s is not None and s.startswith("draft:") else None


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    # engine/load/dtype.py: bfloat16 where the CPU runs it natively and the checkpoint is 16-bit
    dtype: str = "auto"
    # Weight-only quantized GEMMs (engine/load/quant.py): auto = what a GGUF file's matrices carry
    # (int4 for 4-bit codes, int8 for Q8_0), none for float checkpoints.
    quantization: str = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"
    # Compute threads of the engine process; None = one per physical core.
    num_threads: int | None = None
    max_model_len: int | None = None  # None = the model's own context length
    seed: int = 0
    # One GEMM kernel at every row count and one-row GEMMs padded, so a request's output does not
    # depend on the traffic where the default's kernel choice would make it (docs/determinism.md);
    # costs the quantized default its int kernels at small batches.
    deterministic: bool = False
    # On CUDA, decode steps replay captured CUDA graphs (engine/cuda_graphs.py) unless this is set
    # (vLLM's spelling); every other step, and every step off CUDA, runs eagerly anyway.
    enforce_eager: bool = False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Tensor parallelism (docs/scaling.md): the model split over this many ranks (heads and MLP
    # units); each holds 1/N of the weights and of every K/V block, and pays two all-reduces per
    # layer per step.
    tensor_parallel_size: int = 1
    # mp: workers are local processes; ray: Ray actors in a placement group (other nodes too).
    distributed_executor_backend: str = "mp"
    # None: join the Ray cluster this process is in, or start a local one
    ray_address: str | None = None
    # Seconds a collective may wait for a rank before the engine gives up on it (and exits).
    collective_timeout: float = 60.0
    # How embedding requests pool the last hidden states (engine/pooling.py): auto = the
    # checkpoint's sentence-transformers Pooling module, else the last token; none = refuse
    # embeddings.
    pooling: str = "auto"
    # Seconds a grammar compile may take before its request gets a 400 (engine/structured.py).
    grammar_compile_timeout: float = 20.0

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        _require(self.distributed_executor_backend in EXECUTOR_BACKENDS,
                 f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}")
        _require(self.collective_timeout > 0, "collective_timeout must be > 0")
        _require(self.grammar_compile_timeout > 0, "grammar_compile_timeout must be > 0")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}")
        _require(self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend must be one of {ATTENTION_BACKENDS}")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        _require(self.max_model_len is None or self.max_model_len >= 2,
                 "max_model_len must be >= 2")
        _require(self.pooling in POOLING_MODES, f"pooling must be one of {POOLING_MODES}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_memory(text: str, total: int) -> int:
    """'2GiB' -> bytes; '0.3' -> 30% of total; '0' -> 0. Raises ValueError with the accepted
    forms."""
    s = str(text).strip().lower().replace(" ", "")
    if s == "0":
        return 0
    num = s.rstrip("abgikm")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"memory size {text!r}: expected bytes like '2GiB' or a fraction like "
                         "'0.3'") from None
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"memory size {text!r}: expected bytes like '2GiB' or a fraction like "
                         "'0.3'")
    if unit == "" and value < 1:
        return int(value * total)
    return int(value * _UNITS[unit])


def build_config(model: str, **options: Any) -> EngineConfig:
    """Flat options (as on the command line: max_num_seqs=..., block_size=...) -> the nested,
    validated EngineConfig. Unknown names are a TypeError, bad values a ValueError."""
    parts: dict[type, dict[str, Any]] = {SchedulerConfig: {}, CacheConfig: {},
                                         SpeculativeConfig: {}, EngineConfig: {}}
    for key, value in options.items():
        owners = [cls for cls in parts if key in _option_names(cls)]
        if not owners:
            raise TypeError(f"unknown engine option {key!r}")
        parts[owners[0]][key] = value
    return EngineConfig(model=model, scheduler=SchedulerConfig(**parts[SchedulerConfig]),
                        cache=CacheConfig(**parts[CacheConfig]),
                        speculative=SpeculativeConfig(**parts[SpeculativeConfig]),
                        **parts[EngineConfig])


def _option_names(cls: type) -> set[str]:
    """The flat option names a config class owns: EngineConfig's model and nested configs are not
    options (SpeculativeConfig's own `speculative`, the method, is)."""
    names = {f.name for f in fields(cls)}
    return names - {"model", "scheduler", "cache", "speculative"} if cls is EngineConfig else names


def check_one_owner() -> None:
    """Each option lives in exactly one config class: a name in two would reach only the first, and
    the other copy would silently keep its default (how --max-model-len was once ignored)."""
    classes = (SchedulerConfig, CacheConfig, SpeculativeConfig, EngineConfig)
    seen: dict[str, str] = {}
    for cls in classes:
        for name in _option_names(cls):
            if name in seen:
                raise TypeError(f"engine option {name!r} is owned by both {seen[name]} and "
                                f"{cls.__name__}")
            seen[name] = cls.__name__


check_one_owner()
