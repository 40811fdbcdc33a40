"""A step's inputs as one flat int64 tensor: what the engine sends each worker once per step.

Layout: a header of HEADER ints (command, then the length of each section), then the sections in
order: input_ids [T], positions [T], slots [T], query_lens [S], context_lens [S], table_lens [S],
tables (concatenated) [sum table_lens], logits_rows [B], swap_out [2A], swap_in [2B], copies [2C].
Plain integers, sent as raw bytes: no pickle, and one message per step whatever the batch holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.batch import Batch

STEP, STOP = 1, 2
_SECTIONS = ("input_ids", "positions", "slots", "query_lens", "context_lens", "table_lens",
             "tables", "logits_rows", "swap_out", "swap_in", "copies")
HEADER = 1 + len(_SECTIONS)


@dataclass(frozen=True)
class StepInputs:
    """What every rank needs to run one step: the batch, and the block moves to make before it."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]
    logits_rows: list[int]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]

    @classmethod
    def of(cls, batch: Batch, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
           copies: list[tuple[int, int]]) -> StepInputs:
        return cls(batch.input_ids, batch.positions, batch.slots, batch.query_lens,
                   batch.context_lens, batch.tables, batch.logits_rows, swap_out, swap_in, copies)


def pack(s: StepInputs) -> np.ndarray:
    """-> [HEADER + payload] int64."""
    flat_tables = [b for t in s.tables for b in t]
    sections = (s.input_ids, s.positions, s.slots, s.query_lens, s.context_lens,
                [len(t) for t in s.tables], flat_tables, s.logits_rows,
                [x for p in s.swap_out for x in p], [x for p in s.swap_in for x in p],
                [x for p in s.copies for x in p])
    header = [STEP, *map(len, sections)]
    return np.fromiter((x for part in (header, *sections) for x in part), dtype=np.int64)


def stop_message() -> np.ndarray:
    return np.array([STOP] + [0] * (HEADER - 1), dtype=np.int64)


def unpack(a: np.ndarray) -> StepInputs | None:
    """[HEADER + payload] int64 -> the step's inputs; None for STOP. Raises ValueError when
    malformed."""
    if a.ndim != 1 or a.shape[0] < HEADER or a[0] not in (STEP, STOP):
        raise ValueError(f"not a step message: {a.shape[0]} ints, command "
                         f"{a[0] if a.size else None}")
    if a[0] == STOP:
        return None
    lens = a[1:HEADER].tolist()
    if HEADER + sum(lens) != a.shape[0]:
        raise ValueError(f"step message of {a.shape[0]} ints, header says {HEADER + sum(lens)}")
    parts: dict[str, list[int]] = {}
    at = HEADER
    for name, n in zip(_SECTIONS, lens):
        parts[name] = a[at:at + n].tolist()
        at += n
    tables, at = [], 0
    for n in parts["table_lens"]:
        tables.append(parts["tables"][at:at + n])
        at += n

    def pairs(xs: list[int]) -> list[tuple[int, int]]:
        return list(zip(xs[::2], xs[1::2]))

    return StepInputs(parts["input_ids"], parts["positions"], parts["slots"], parts["query_lens"],
                      parts["context_lens"], tables, parts["logits_rows"], pairs(parts["swap_out"]),
                      pairs(parts["swap_in"]), pairs(parts["copies"]))
