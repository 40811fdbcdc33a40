"""Batch: one forward pass's flattened inputs (ids, positions, KV slots, block tables), shared by
the target model's step and the draft model's proposals."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.backend import AttentionBackend, BatchLayout

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


class Batch:
    """One forward's flattened inputs, built sequence by sequence (the target's step, or a
    draft's)."""

    __slots__ = ("block_size", "input_ids", "positions", "slots", "query_lens", "context_lens",
                 "tables", "logits_rows")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.query_lens: list[int] = []
        self.context_lens: list[int] = []
        self.tables: list[list[int]] = []
        self.logits_rows: list[int] = []

    def add(self, ids: list[int], start: int, table: list[int], num_logits: int) -> None:
        """ids go to positions start.. of the sequence with this block table; logits for its last
        num_logits tokens."""
        bs, n = self.block_size, len(ids)
        self.input_ids += ids
        if n == 1:
            self.positions.append(start)
            self.slots.append(table[start // bs] * bs + start % bs)
        else:
            span = range(start, start + n)
            self.positions += span
            self.slots += [table[p // bs] * bs + p % bs for p in span]
        self.query_lens.append(n)
        self.context_lens.append(start)
        self.tables.append(table)
        if num_logits:
            end = len(self.input_ids)
            self.logits_rows += range(end - num_logits, end)

    def forward(self, model: torch.nn.Module, kv: torch.Tensor, backend: AttentionBackend,
                device: torch.device) -> torch.Tensor:
        """-> logits [len(logits_rows), V] float32."""
        rows = torch.tensor(self.logits_rows, dtype=torch.int64, device=device)
        logits: torch.Tensor = model(*self._inputs(kv, backend, device), rows)
        return logits.float()

    def forward_hidden(self, model: LlamaForCausalLM, kv: torch.Tensor, backend: AttentionBackend,
                       device: torch.device, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [len(logits_rows), V] float32, the last hidden states of `rows` [len(rows), E]
        float32, after the final norm): one forward for sampled and pooled (embedding) rows."""
        h = model.hidden_states(*self._inputs(kv, backend, device))  # [T, E]
        logits = model.logits(model.final_norm(h[self.logits_rows]))  # [B, V]
        return logits.float(), model.final_norm(h[rows]).float()

    def _inputs(self, kv: torch.Tensor, backend: AttentionBackend, device: torch.device) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, object, AttentionBackend]:
        layout = BatchLayout(self.query_lens, self.context_lens, self.tables, self.block_size,
                             torch.tensor(self.slots, dtype=torch.int64, device=device))
        ids = torch.tensor(self.input_ids, dtype=torch.int64, device=device)
        positions = torch.tensor(self.positions, dtype=torch.int64, device=device)
        return ids, positions, kv, backend.plan(layout), backend
