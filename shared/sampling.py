"""SamplingParams: what a client may ask of the sampler, validated once at the edge.

Validation is strict and runs wherever a SamplingParams is built: in the gateway, in the SDK, and
again in the engine when it decodes an ADD (a client that skips the SDK is still checked). Every
field has a type (a JSON boolean is a boolean: "false" and 1 are not; an integer is an int: not a
bool, not 2.0) and a range (finite numbers only), chosen so that no accepted value can break the
engine's arithmetic: no overflow in beam scoring, no division by zero, no integer too large for the
wire. Token ids are checked against the model's vocabulary by the engine, which alone knows it. The
limits are the constants below, and docs/reliability.md lists them in a table.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from shared import thinking
from shared.constraints import Constraint
from shared.errors import InvalidRequest

MAX_TOKENS = 1 << 20  # an upper bound before the model's context (the engine checks that too)
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 0.01  # above 0: logits / 1e-30 overflow to inf and the softmax gives NaN
MAX_TOP_K = 1 << 20  # larger than any vocabulary; the sampler clamps to the vocabulary
MAX_PENALTY = 2.0  # presence and frequency penalties: [-2, 2], as OpenAI
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits are divided or multiplied by it
MAX_LOGIT_BIAS = 100.0  # |bias|, as OpenAI
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 512  # characters per stop string (the detokenizer holds back that much text)
MAX_STOP_TOKEN_IDS = 1024
MAX_SALT_CHARS = 256  # cache_salt: a tenant id or a hash of one, not a payload
MAX_TOKEN_ID = (1 << 31) - 1  # a bound for the wire; the engine checks ids against the vocabulary
MAX_LOGPROBS = 20
MAX_N = 64  # n, best_of and beam_width
LENGTH_PENALTY_RANGE = (-10.0, 10.0)  # MAX_TOKENS ** 10 is ~1e60: finite, and never 0 at -10
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # what the wire (orjson) carries
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)  # Add.priority: lower is served first


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Matched by the detokenizer (gateway / SDK side); the engine never sees text.
    stop: tuple[str, ...] = ()
    # OpenAI penalties over the output tokens: logit -= presence * [count > 0] + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF / CTRL: over prompt and output tokens, logit / p when positive, logit * p when negative.
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to the logits; a JSON object {"id": bias} is accepted too.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no logprobs; k >= 0: the sampled token's logprob plus the k most likely tokens' (raw
    # model log_softmax, before any penalty or temperature), per generated token.
    logprobs: int | None = None
    # n sequences are returned; best_of >= n are generated (prompt prefilled once, blocks shared)
    # and the n with the highest cumulative logprob are kept. best_of > n streams nothing until the
    # end.
    n: int = 1
    best_of: int | None = None
    # Beam search (deterministic, as transformers' generate(num_beams=..., do_sample=False)):
    # beam_width beams, the n best returned; score = sum logprob / generated_len ** length_penalty.
    # Every field that would change a sampled distribution (temperature other than 0 or 1, top-k/p,
    # min-p, penalties, logit_bias) is refused with it rather than ignored.
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never", as transformers
    # Per-request opt-out of speculative decoding (when the engine runs it); the output distribution
    # is the same either way, so this only trades the proposer's work against fewer steps.
    speculative: bool = True
    # Structured output (shared/constraints.py): the output must match it; the engine masks the
    # sampler with an xgrammar matcher. None: free text.
    constraint: Constraint | None = None
    # None: no prompt logprobs; k >= 0: each prompt token's logprob and rank plus the k most likely
    # tokens at its position (vLLM's prompt_logprobs; the raw model's log_softmax). The engine then
    # skips the prefix cache for this request (a cached prefix has no logits).
    prompt_logprobs: int | None = None
    # Prefix-cache isolation (vLLM's spelling): mixed into the hash of the prompt's first KV block,
    # so requests with different salts never share cached blocks, nor learn of each other's prompts
    # through cached_tokens (docs/prefix_caching.md). None: the shared cache.
    cache_salt: str | None = None
    # Reasoning models: the reasoning parser's tags' ids (no start ids: the prompt opened the
    # block) and the end tag's other spellings, and vLLM's thinking_token_budget, after which the
    # engine forces the end ids (shared/thinking.py).
    reasoning_start_ids: tuple[int, ...] = ()
    reasoning_end_ids: tuple[int, ...] = ()
    thinking_token_budget: int | None = None
    reasoning_end_spellings: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        # Lists arrive from JSON; keep the frozen record hashable and immutable.
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
        object.__setattr__(self, "stop", stop)
        for name, ids in thinking.as_tuples(self).items():
            object.__setattr__(self, name, ids)
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        object.__setattr__(self, "constraint", Constraint.from_wire(self.constraint))
        self._check_salt()
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1 or self.use_beam_search

    @property
    def num_seqs(self) -> int:
        """Sequences the engine runs for this request (best_of, or the beam width)."""
        if self.use_beam_search:
            return self.beam_width
        return self.best_of or self.n

    @property
    def one_sequence(self) -> bool:
        """The engine computes this request as a single sequence: no choices to fork, no beams."""
        return self.num_seqs == 1 and not self.use_beam_search

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))

    def validate(self) -> None:
        """Every field's type and range, then the combinations: InvalidRequest naming the field."""
        _int(self.max_tokens, "max_tokens", 1, MAX_TOKENS)
        _num(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        _check(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE, "temperature",
               f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], got "
               f"{self.temperature!r}")
        _num(self.top_p, "top_p", 0.0, 1.0)
        _check(self.top_p > 0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _int(self.top_k, "top_k", 0, MAX_TOP_K, " (0 = off)")
        _num(self.min_p, "min_p", 0.0, 1.0)
        if self.seed is not None:
            _int(self.seed, "seed", *SEED_RANGE)
        _bool(self.ignore_eos, "ignore_eos")
        _int(self.min_tokens, "min_tokens", 0, self.max_tokens, " (max_tokens)")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _int(t, "stop_token_ids", 0, MAX_TOKEN_ID, "", what="must hold integer token ids")
        _check(len(self.stop) <= MAX_STOP, "stop",
               f"may hold at most {MAX_STOP} strings, got {len(self.stop)}")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in self.stop), "stop",
               f"must be non-empty strings of at most {MAX_STOP_LEN} characters")
        _num(self.presence_penalty, "presence_penalty", -MAX_PENALTY, MAX_PENALTY)
        _num(self.frequency_penalty, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY)
        _num(self.repetition_penalty, "repetition_penalty", *REPETITION_PENALTY_RANGE)
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
               f"may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        for t, b in self.logit_bias:
            _int(t, "logit_bias", 0, MAX_TOKEN_ID, "", what="keys must be integer token ids")
            _num(b, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, what="values must be numbers")
        if self.logprobs is not None:
            _int(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int(self.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)
        _int(self.n, "n", 1, MAX_N)
        if self.best_of is not None:
            _int(self.best_of, "best_of", self.n, MAX_N, " (n)")
        _bool(self.use_beam_search, "use_beam_search")
        _int(self.beam_width, "beam_width", 1, MAX_N)
        _num(self.length_penalty, "length_penalty", *LENGTH_PENALTY_RANGE)
        _check(type(self.early_stopping) is bool or self.early_stopping == "never",
               "early_stopping", f'must be true, false or "never", got {self.early_stopping!r}')
        _bool(self.speculative, "speculative")
        if self.constraint is not None:
            # Beam search would need a matcher per beam candidate; min_tokens masks the stop ids,
            # which can be the only tokens the grammar allows once the output is complete.
            _check(not self.use_beam_search, "use_beam_search",
                   "cannot be used with structured output")
            _check(self.min_tokens == 0, "min_tokens", "cannot be used with structured output: "
                   "the grammar decides when the output may end")
        thinking.validate(self.reasoning_start_ids, self.reasoning_end_ids,
                          self.thinking_token_budget, self.use_beam_search,
                          self.constraint is not None, self.reasoning_end_spellings)
        if self.use_beam_search:
            self._validate_beam_search()
        else:
            for name, neutral in _BEAM_ONLY:
                _check(getattr(self, name) == neutral, name,
                       "applies to beam search only: set use_beam_search=true")

    def _validate_beam_search(self) -> None:
        """Beam search here is deterministic and scores raw log-softmax, as transformers'
        generate with do_sample=False: anything that would reshape the distribution is
        refused, never ignored."""
        _check(self.n <= self.beam_width, "n",
               f"must be <= beam_width with beam search, got {self.n} > {self.beam_width}")
        _check(self.best_of is None, "best_of",
               "cannot be used with beam search (beam_width sets the beams)")
        _check(self.logprobs is None, "logprobs", "are not returned for beam search outputs")
        # temperature 1 (the default) leaves the log-softmax unchanged, 0 means "deterministic":
        # both honoured
        _check(self.temperature in (0.0, 1.0), "temperature",
               "must be 0 or 1 (the default) with beam search, which does not sample; got "
               f"{self.temperature!r}")
        for name, neutral in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            _check(value == neutral, name, f"cannot be used with beam search (it does not sample); "
                   f"leave it at {neutral!r}, got {value!r}")
        _check(not self.logit_bias, "logit_bias", "cannot be used with beam search")

    def _check_salt(self) -> None:
        salt = self.cache_salt
        ok = salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_SALT_CHARS)
        _check(ok, "cache_salt", f"must be a non-empty string of at most {MAX_SALT_CHARS} "
               f"characters, got {salt!r}"[:200])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        if not isinstance(data, dict):
            raise InvalidRequest("sampling parameters must be an object, got "
                                 f"{type(data).__name__}",
                                 param="params")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameters: {unknown}", param=str(unknown[0]))
        return cls(**data)


def check_priority(priority: object) -> int:
    """A request's priority (lower is served first), as the gateway, the SDK and the engine accept
    it."""
    _int(priority, "priority", *PRIORITY_RANGE, " (lower is served first)")
    assert isinstance(priority, int)
    return priority


# The beam-search fields and their neutral values, which a request without beam search must keep.
_BEAM_ONLY = (("beam_width", 1), ("length_penalty", 1.0), ("early_stopping", False))


def _check(ok: bool, param: str, why: str) -> None:
    if not ok:
        message = f"{param} {why}"
        raise InvalidRequest(message if len(message) <= 300 else message[:297] + "...", param=param)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(x: object, param: str, lo: int, hi: int, note: str = "",
         what: str = "must be an integer") -> None:
    ok = _is_int(x) and lo <= x <= hi  # type: ignore[operator]
    _check(ok, param, f"{what} in [{lo}, {hi}]{note}, got {x!r}")


def _num(x: object, param: str, lo: float, hi: float, what: str = "must be a number") -> None:
    ok = (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
          and lo <= x <= hi)
    _check(ok, param, f"{what} in [{lo:g}, {hi:g}], got {x!r}")


def _bool(x: object, param: str) -> None:
    _check(isinstance(x, bool), param, f"must be true or false, got {x!r}")


def _as_tuple(value: object, param: str) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidRequest(f"{param} must be a list, got {value!r}"[:200], param=param)
    return tuple(value)


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """{"id": bias} (JSON objects have string keys) or [[id, bias], ...] (the wire) -> ((id, bias),
    ...); only decimal-integer keys are converted, every type is checked again by validate()."""
    if isinstance(value, dict):
        items: list[Any] = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise InvalidRequest(f"logit_bias must map token ids to numbers, got {value!r}"[:200],
                             param="logit_bias")
    pairs = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise InvalidRequest("logit_bias must map token ids to numbers", param="logit_bias")
        t, b = item
        if isinstance(t, str) and t.isascii() and t.isdigit() and len(t) <= 10:
            t = int(t)
        pairs.append((t, b))
    return tuple(pairs)
