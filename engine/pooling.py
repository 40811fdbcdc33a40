"""Embeddings from the serving engine: how this engine pools (from --pooling and the checkpoint's
own sentence-transformers files), which rows of a step each embedding request contributes, and the
vector it finally gets.

An embedding request is a prompt that is prefilled and never decoded. It is scheduled like any
prompt (chunked under the token budget, so it never holds decodes back), samples nothing, and
frees its KV blocks when its last chunk is computed. It never starts on a cached prefix: the
cached tokens' hidden states are not kept, and mean pooling needs every row. Per step the runner
returns each embedding chunk's contribution (PoolRows.reduce): the sum of its rows for mean
pooling, the last row of the last chunk for last-token pooling, the first row of the first chunk
for cls pooling. The scheduler adds them up (`accumulate`), and `finish` turns the total into
the vector sent back."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.admission import Limits
from shared.embedding import PoolingInfo, PoolingParams
from shared.errors import InvalidRequest

log = logging.getLogger("conveyor.pooling")

# sentence-transformers' 1_Pooling/config.json flags -> our modes (the others we do not compute).
_ST_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "",
    "pooling_mode_mean_sqrt_len_tokens": "",
    "pooling_mode_weightedmean_tokens": "",
}
_ST_KEPT = ("models.Transformer", "models.Pooling", "models.Normalize")


def resolve(folder: Path, hidden_size: int, flag: str) -> PoolingInfo:
    """How this engine pools. flag: --pooling (auto: the checkpoint's sentence-transformers Pooling
    module, else last-token pooling, as vLLM does for decoders). Normalised when the checkpoint's
    pipeline has a Normalize module, or when it has no sentence-transformers files at all."""
    config = _json(folder / "config.json") or {}
    dims = config.get("matryoshka_dimensions")
    dims = tuple(sorted(int(d) for d in dims)) if isinstance(dims, list) else ()
    matryoshka = bool(config.get("is_matryoshka")) or bool(dims)
    if flag == "none":
        return PoolingInfo("", False, hidden_size, refusal="it was started with --pooling none")
    mode, normalize, refusal = _sentence_transformers(folder)
    if flag != "auto":
        mode = flag
        refusal = refusal if refusal.startswith("its sentence-transformers pipeline") else ""
    if refusal:
        return PoolingInfo("", False, hidden_size, refusal=refusal)
    info = PoolingInfo(mode or "last", normalize, hidden_size, matryoshka, dims)
    log.info(
        "embeddings: %s pooling, %snormalised, %d dimensions%s",
        info.mode,
        "" if normalize else "not ",
        hidden_size,
        " (Matryoshka)" if matryoshka else "",
    )
    return info


def _sentence_transformers(folder: Path) -> tuple[str, bool, str]:
    """-> (mode, or "" when the checkpoint does not say; normalize; why it cannot be reproduced, or
    "").
    """
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return "", True, ""
    mode, normalize = "", False
    for m in modules:
        kind, path = str(m.get("type", "")), str(m.get("path", ""))
        if not kind.endswith(_ST_KEPT):
            return (
                "",
                False,
                (
                    f"its sentence-transformers pipeline has a {kind} module "
                    f"({path or 'no path'}), "
                    "which Conveyor does not apply"
                ),
            )
        if kind.endswith("models.Normalize"):
            normalize = True
        elif kind.endswith("models.Pooling"):
            cfg = _json(folder / path / "config.json") or {}
            asked = [k for k in _ST_MODES if cfg.get(k)]
            if len(asked) != 1 or not _ST_MODES[asked[0]]:
                return (
                    "",
                    False,
                    (
                        f"its sentence-transformers Pooling module asks for {asked or 'no mode'}; "
                        "Conveyor pools by one of last, mean or cls "
                        "(start with --pooling to choose)"
                    ),
                )
            if cfg.get("include_prompt") is False:
                return (
                    "",
                    False,
                    (
                        "its sentence-transformers Pooling module leaves out the prompt "
                        "(include_prompt false), which Conveyor does not do"
                    ),
                )
            mode = _ST_MODES[asked[0]]
    return mode, normalize, ""


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check(
    info: PoolingInfo, limits: Limits, prompt_token_ids: list[int], params: PoolingParams
) -> None:
    """Raises InvalidRequest naming the field when an embedding request can never run
    here. The whole input is prefilled, so it may take the model's whole context (no
    generated token follows it)."""
    info.check(params)
    vocab = limits.vocab_size
    if not prompt_token_ids:
        raise InvalidRequest("the input is empty", param="input")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise InvalidRequest(f"input token ids must be in [0, {vocab})", param="input")
    if len(prompt_token_ids) > limits.max_model_len:
        raise InvalidRequest(
            f"the input has {len(prompt_token_ids)} tokens; this model embeds at most "
            f"{limits.max_model_len} (set truncate_prompt_tokens to keep only the last ones)",
            param="input",
            code="context_length_exceeded",
        )


class PoolRows:
    """One step's pooled rows: which rows of the batch each embedding chunk contributes (plan index
    -> its span in `rows`)."""

    __slots__ = ("mode", "rows", "spans", "seqs")

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.rows: list[int] = []
        self.spans: dict[int, tuple[int, int]] = {}
        self.seqs = 0  # embedding chunks in the step, whether or not they contribute rows

    def add(self, index: int, first_row: int, start: int, end: int, num_tokens: int) -> None:
        """Plan entry `index` computes positions start..end-1 of a num_tokens-long input at batch
        rows first_row.. ."""
        self.seqs += 1
        n = end - start
        if self.mode == "mean":
            rows: range = range(first_row, first_row + n)
        elif self.mode == "last":
            rows = range(first_row + n - 1, first_row + n) if end == num_tokens else range(0)
        else:  # cls: the first token
            rows = range(first_row, first_row + 1) if start == 0 else range(0)
        if rows:
            a = len(self.rows)
            self.rows += rows
            self.spans[index] = (a, len(self.rows))

    def reduce(self, hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """hidden: [len(rows), E] float32 -> plan index -> its contribution [E] (a sum of rows)."""
        return {i: hidden[a:b].sum(0) for i, (a, b) in self.spans.items()}


def accumulate(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    """The running sum of an embedding's contributions (None: nothing yet)."""
    if part is None:
        return total
    return part.clone() if total is None else total + part


def finish(
    total: torch.Tensor, num_tokens: int, info: PoolingInfo, params: PoolingParams
) -> list[float]:
    """The request's vector: the mean (for mean pooling), its first `dimensions` numbers
    (Matryoshka), L2-normalised when the engine normalises (after the cut, so the shorter
    vector is unit length)."""
    v = total / num_tokens if info.mode == "mean" else total
    if params.dimensions is not None:
        v = v[: params.dimensions]
    if info.normalize:
        v = F.normalize(v, dim=0)
    out: list[float] = v.tolist()
    return out
