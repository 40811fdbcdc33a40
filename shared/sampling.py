"""SamplingParams: what a client may ask of the sampler, validated once at the edge."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from shared.errors import InvalidRequest


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
    # None: no logprobs; k >= 0: the sampled token's logprob plus the k most likely tokens' (raw model
    # log_softmax, before any penalty or temperature), per generated token.
    logprobs: int | None = None
    # n sequences are returned; best_of >= n are generated (prompt prefilled once, blocks shared) and the
    # n with the highest cumulative logprob are kept. best_of > n streams nothing until the end.
    n: int = 1
    best_of: int | None = None
    # Beam search (deterministic; temperature and top-k/p are ignored): beam_width beams, the n best
    # returned; score = sum logprob / generated_len ** length_penalty, as transformers' generate.
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never", as transformers
    # Per-request opt-out of speculative decoding (when the engine runs it); the output distribution
    # is the same either way, so this only trades the proposer's work against fewer steps.
    speculative: bool = True

    def __post_init__(self) -> None:
        # Lists arrive from JSON; keep the frozen record hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise InvalidRequest("logit_bias must map token ids to numbers", param="logit_bias") from None
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
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))

    def validate(self) -> None:
        def check(ok: bool, param: str, why: str) -> None:
            if not ok:
                raise InvalidRequest(f"{param} {why}", param=param)

        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
              f"must be an integer >= 1, got {self.max_tokens!r}")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
              f"must be >= 0, got {self.temperature!r}")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
              f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              "must be an integer in [0, max_tokens]")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(_is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias",
              "must map token ids >= 0 to biases in [-100, 100]")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
              f"must be an integer in [0, 20], got {self.logprobs!r}")
        check(isinstance(self.n, int) and 1 <= self.n <= 64, "n", f"must be an integer in [1, 64], got {self.n!r}")
        check(self.best_of is None or (isinstance(self.best_of, int) and self.n <= self.best_of <= 64), "best_of",
              "must be an integer in [n, 64]")
        check(isinstance(self.beam_width, int) and 1 <= self.beam_width <= 64, "beam_width", "must be in [1, 64]")
        check(not self.use_beam_search or self.n <= self.beam_width, "n", "must be <= beam_width with beam search")
        check(not self.use_beam_search or self.best_of is None, "best_of", "cannot be used with beam search")
        check(_is_num(self.length_penalty), "length_penalty", "must be a number")
        check(self.early_stopping in (True, False, "never"), "early_stopping", 'must be true, false or "never"')
        check(isinstance(self.speculative, bool), "speculative", "must be true or false")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidRequest(f"unknown sampling parameters: {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise InvalidRequest(f"bad sampling parameters: {e}") from None


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
