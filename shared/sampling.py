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

    def __post_init__(self) -> None:
        # Lists arrive from JSON; keep the frozen record hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        def check(ok: bool, param: str, why: str) -> None:
            if not ok:
                raise InvalidRequest(f"{param} {why}", param=param)

        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature!r}")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be an integer in [0, max_tokens]")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")

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
