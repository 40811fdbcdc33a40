"""Embeddings on the wire: what a request asks of the engine's pooler (PoolingParams, in ADD), what
the engine says it can pool (PoolingInfo, in READY), and the checks both sides share.

An embedding request is a prompt the engine prefills and never decodes: its final hidden states
(after the model's final norm) are pooled into one vector, and its KV blocks are freed as soon as
the last chunk is computed. How it pools (last token, mean, first token) and whether it
L2-normalises are the engine's, from --pooling and the checkpoint's own sentence-transformers files
(engine/pooling.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequest

MAX_DIMENSIONS = 1 << 20  # a bound for the wire; the engine checks against the model's size


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """dimensions: keep the first N numbers of the pooled vector (Matryoshka models only), before
    the normalisation; None keeps all of them."""

    dimensions: int | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (type(d) is not int or not 1 <= d <= MAX_DIMENSIONS):
            raise InvalidRequest(
                f"dimensions must be a positive integer, not {d!r}", param="dimensions"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"dimensions": self.dimensions}

    @classmethod
    def from_dict(cls, d: Any) -> PoolingParams:
        if not isinstance(d, dict) or set(d) - {"dimensions"}:
            raise InvalidRequest(
                f"pooling must be an object with at most 'dimensions', not {d!r}", param="pooling"
            )
        return cls(d.get("dimensions"))


@dataclass(frozen=True, slots=True)
class PoolingInfo:
    """What one engine's pooler does, announced in READY. mode: last | mean | cls, or "" with
    `refusal` saying why this engine cannot pool at all. size: the pooled vector's length.
    matryoshka: the model was trained so that a prefix of its vector is an embedding too
    (config.json's is_matryoshka or matryoshka_dimensions); dimensions: the prefixes it was trained
    for (empty: any)."""

    mode: str
    normalize: bool
    size: int
    matryoshka: bool = False
    dimensions: tuple[int, ...] = ()
    refusal: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "normalize": self.normalize,
            "size": self.size,
            "matryoshka": self.matryoshka,
            "dimensions": list(self.dimensions),
            "refusal": self.refusal,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolingInfo:
        return cls(
            str(d["mode"]),
            bool(d["normalize"]),
            int(d["size"]),
            bool(d.get("matryoshka", False)),
            tuple(int(x) for x in d.get("dimensions", ())),
            str(d.get("refusal", "")),
        )

    def check(self, params: PoolingParams) -> None:
        """Raises InvalidRequest naming the field when this engine cannot answer the request as
        asked."""
        if self.refusal:
            raise InvalidRequest(
                f"this server cannot compute embeddings: {self.refusal}", param="model"
            )
        d = params.dimensions
        if d is None or d == self.size:
            return
        if not self.matryoshka:
            raise InvalidRequest(
                f"this model does not support 'dimensions' (it is not a Matryoshka model: its "
                f"config.json sets neither is_matryoshka nor matryoshka_dimensions); its "
                f"embeddings have {self.size} dimensions",
                param="dimensions",
            )
        if d > self.size or (self.dimensions and d not in self.dimensions):
            allowed = ", ".join(map(str, self.dimensions)) if self.dimensions else f"1..{self.size}"
            raise InvalidRequest(
                f"dimensions must be one of {allowed} for this model, not {d}", param="dimensions"
            )


CANNOT_POOL = PoolingInfo(
    "", False, 0, refusal="the engine did not announce a pooler (an older engine)"
)


def truncate_tokens(
    ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int
) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: the model's whole context).
    Without it, an input longer than the context is refused, never cut in silence."""
    k = truncate_prompt_tokens
    if k is not None:
        if type(k) is not int or (k < 1 and k != -1):
            raise InvalidRequest(
                f"truncate_prompt_tokens must be -1 or a positive integer, not {k!r}",
                param="truncate_prompt_tokens",
            )
        if k > max_model_len:
            raise InvalidRequest(
                f"truncate_prompt_tokens {k} is larger than this model's context of "
                f"{max_model_len} tokens",
                param="truncate_prompt_tokens",
            )
        keep = max_model_len if k == -1 else k
        ids = ids[-keep:]
    if not ids:
        raise InvalidRequest("an input is empty", param="input")
    if len(ids) > max_model_len:
        raise InvalidRequest(
            f"an input has {len(ids)} tokens; this model embeds at most {max_model_len} "
            "(set truncate_prompt_tokens to keep only the last ones)",
            param="input",
            code="context_length_exceeded",
        )
    return ids


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    request_id: str
    embedding: list[float]
    num_prompt_tokens: int  # after truncate_prompt_tokens
