"""Decode steps replayed as CUDA graphs.

On a GPU a small model's decode step is bound by launching kernels, not by running them: 30
layers of a dozen small ops each, one Python call per op (docs/performance.md, "Triton kernels
and the engine on a GPU"). A CUDA graph records a whole forward's launches once and replays them
with one call. A graph replays fixed shapes over fixed memory, so the step's inputs live in
static buffers here, batches are padded up to the next captured size (a bucket), and the Triton
decode kernel gets the engine's longest context as its bound (its real lengths are read from
the buffers on the device). Padded rows attend over one key of block 0 and write no K/V (slot
-1); their outputs are never read.

Only decode-only steps (one new token per sequence, every row sampled) replay; prompts, chunks,
drafts, prompt logprobs and embeddings run eagerly. Off CUDA the same static-buffer path runs
without capture (capture=False), so the padding and the buffers are tested on every machine under
TRITON_INTERPRET=1.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from kernels.triton_backend import TritonBackend, TritonMeta

if TYPE_CHECKING:
    from engine.batch import Batch
    from engine.models.llama import LlamaForCausalLM

log = logging.getLogger("conveyor.cuda_graphs")

MAX_CAPTURE_SIZE = 512  # vLLM's default: larger decode batches are rare and run eagerly


def bucket_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, then every multiple of 16 up to max_batch
    (vLLM's spacing): a step pads at most 15 rows, and the graphs stay few."""
    top = max(1, min(max_batch, MAX_CAPTURE_SIZE))
    sizes = [s for s in (1, 2, 4, 8) if s < top]
    sizes += range(16, top, 16)
    return [*sizes, top]


class DecodeGraphs:
    """One captured forward per bucket over one set of static input buffers. The graph's output is
    the final-normed hidden state of every row; the LM head runs outside it on the real rows only,
    so padding costs no vocabulary-sized GEMM rows."""

    def __init__(self, model: LlamaForCausalLM, kv: torch.Tensor, backend: TritonBackend,
                 max_batch: int, max_len: int, block_size: int, capture: bool) -> None:
        self.model, self.kv, self.backend = model, kv, backend
        self.sizes = bucket_sizes(max_batch)
        self.max_len, self.block_size, self.capture = max_len, block_size, capture
        self.max_blocks = -(-max_len // block_size)
        self.replays = 0  # decode steps served from the buffers (what the tests and bench read)
        device, top = kv.device, self.sizes[-1]
        # tokens, positions, slots ([3, top] int64); sequence lengths; block tables
        self.token_buf = torch.zeros(3, top, dtype=torch.int64, device=device)
        self.token_buf[2] = -1
        self.len_buf = torch.ones(top, dtype=torch.int32, device=device)
        self.table_buf = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=device)
        self.rows = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def fits(self, batch: Batch) -> bool:
        """Whether this step can replay: decode rows only, each sampled, within the buffers."""
        n = len(batch.query_lens)
        return (0 < n <= self.sizes[-1] and len(batch.input_ids) == n
                and len(batch.logits_rows) == n and batch.logits_rows[-1] == n - 1
                and max(batch.context_lens) < self.max_len)

    def run(self, batch: Batch) -> torch.Tensor:
        """-> logits [n, V] float32 of a step that fits()."""
        n = len(batch.query_lens)
        size = next(s for s in self.sizes if s >= n)
        self._fill(batch, size)
        if self.capture:
            self.graphs[size].replay()
            hidden = self.outputs[size]
        else:
            hidden = self._forward(size)
        self.replays += 1
        return self.model.logits(hidden[:n])

    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first, into one memory pool (smaller graphs
        reuse the largest one's memory). The buffers hold padding only, so nothing is written to
        the cache."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize(self.kv.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        log.info("captured %d decode graphs (batch sizes %d..%d) in %.1f s", len(self.sizes),
                 self.sizes[0], self.sizes[-1], time.perf_counter() - t0)

    def _fill(self, batch: Batch, size: int) -> None:
        """Copy the step into the buffers, rows n..size-1 as padding: token 0 at position 0, no
        slot, one key of block 0. Three host-to-device copies."""
        n = len(batch.query_lens)
        pad = size - n
        tokens = torch.tensor([batch.input_ids + [0] * pad, batch.positions + [0] * pad,
                               batch.slots + [-1] * pad], dtype=torch.int64)
        lens = torch.tensor([c + 1 for c in batch.context_lens] + [1] * pad, dtype=torch.int32)
        width = min(self.max_blocks, max(len(t) for t in batch.tables))
        rows = [t[:width] + [0] * (width - len(t[:width])) for t in batch.tables]
        tables = torch.tensor(rows + [[0] * width] * pad, dtype=torch.int32)  # one tensor a step
        self.token_buf[:, :size].copy_(tokens, non_blocking=True)
        self.len_buf[:size].copy_(lens, non_blocking=True)
        self.table_buf[:size, :width].copy_(tables, non_blocking=True)

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the buffers -> final-normed hidden [size, E]."""
        ids, positions = self.token_buf[:2, :size]
        h = self.model.hidden_states(ids, positions, self.kv, self._meta(size), self.backend)
        return self.model.final_norm(h)

    def _meta(self, size: int) -> TritonMeta:
        """The Triton backend's step metadata as views of the buffers: `size` decode rows, each
        row its own sequence."""
        tables, lens, rows = self.table_buf[:size], self.len_buf[:size], self.rows[:size]
        none = self.rows[:0]
        return TritonMeta(
            slot_mapping=self.token_buf[2, :size], block_tables=tables, seq_lens=lens,
            context_lens=lens - 1, query_start_loc=self.rows[:size + 1],
            decode_rows=rows, decode_seq_lens=lens, decode_block_tables=tables,
            decode_max_len=self.max_len,
            prefill_q_start=none, prefill_q_lens=none, prefill_ctx_lens=none,
            prefill_block_tables=tables[:0], prefill_q_lens_list=[])
