"""ModelRunner: turns a StepPlan into one varlen forward pass, then one sampling call (and, for
sequences with drafts, one verification call), and returns what it computed as a StepOutput."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import torch

from engine import prompt_logprobs
from engine.batch import Batch
from engine.kv_cache import KVCache
from engine.observe.trace import no_mark
from engine.pooling import PoolRows
from engine.sampler import Sampler
from engine.sequence import LogprobEntry, Sequence
from engine.speculative.verify import verify
from engine.step import Drafts, StepOutput, StepPlan
from kernels.backend import AttentionBackend

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphs
    from engine.models.llama import LlamaForCausalLM
    from engine.speculative import Proposer

log = logging.getLogger("conveyor.runner")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device, proposer: Proposer | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = kv_cache.block_size
        self.device = device
        self.sampler = Sampler(device)
        self.proposer = proposer
        self.mark = no_mark  # where a step's phases begin, for a trace (EngineCore.set_tracer)
        # how embedding requests pool (EngineCore sets it: engine/pooling.py)
        self.pool_mode = "last"
        # decode steps replayed as CUDA graphs (engine/build.py attaches them on CUDA)
        self.graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Compute every scheduled token; sample one token per sequence the plan says samples. A
        sequence with drafts computes its last token plus the drafts; its token is the one after the
        drafts it accepted."""
        self._swap(plan)
        drafts = self._propose(plan)
        batch = Batch(self.block_size)
        sampling: list[tuple[Sequence, Drafts | None]] = []
        pool = PoolRows(self.pool_mode)
        for i, (seq, n) in enumerate(zip(plan.seqs, plan.num_new_tokens)):
            start = seq.num_computed_tokens
            if seq.request.pooling is not None:  # an embedding: rows pooled, nothing sampled
                pool.add(i, len(batch.input_ids), start, start + n, seq.num_tokens)
                batch.add(seq.token_ids[start:start + n], start, seq.block_table, 0)
                continue
            d = drafts.get(i) if drafts else None
            if d is not None:
                batch.add([seq.token_ids[-1], *d.token_ids], start, seq.block_table, n)
                sampling.append((seq, d))
                continue
            samples = plan.sampled[i] is not None
            batch.add(seq.token_ids[start:start + n], start, seq.block_table, 1 if samples else 0)
            if samples:
                sampling.append((seq, None))
        num_sampling_rows = len(batch.logits_rows)
        # prompt logprobs: rows after the sampling ones
        score_rows, scored = prompt_logprobs.plan_rows(plan)
        batch.logits_rows += score_rows
        self.mark("forward")
        pooled: dict[int, torch.Tensor] = {}
        if pool.rows:
            logits, hidden = self._forward_hidden(batch, pool.rows)
            pooled = pool.reduce(hidden)
        else:
            logits = self._forward(batch)  # [rows, V]
        self.mark("sample")
        scores = prompt_logprobs.score(logits[num_sampling_rows:], plan, scored) if scored else None
        logits = logits[:num_sampling_rows]
        output = self._sample(logits, sampling, bool(drafts)) if sampling else StepOutput()
        output.prompt_logprobs, output.pooled = scores, pooled
        return output

    def _sample(self, logits: torch.Tensor, sampling: list[tuple[Sequence, Drafts | None]],
                drafts: bool) -> StepOutput:
        try:
            if not drafts:
                tokens, logprobs = self.sampler(logits, [seq for seq, _ in sampling])
                return StepOutput(tokens, None, logprobs)
            return self._sample_and_verify(logits, sampling)
        except Exception:
            log.exception("sampling %d sequences in one call failed; sampling them one by one",
                          len(sampling))
            return self._one_by_one(logits, sampling)

    def _propose(self, plan: StepPlan) -> dict[int, Drafts]:
        """The plan's drafts with their tokens: a draft model proposes them now, in one batch."""
        if not plan.drafts:
            return plan.drafts
        assert self.proposer is not None
        where = list(plan.drafts)
        filled = self.proposer.propose([plan.seqs[i] for i in where],
                                       [plan.drafts[i] for i in where])
        return dict(zip(where, filled))

    def _sample_and_verify(self, logits: torch.Tensor,
                           sampling: list[tuple[Sequence, Drafts | None]]) -> StepOutput:
        """Rows of plain sequences go to the sampler, rows of sequences with drafts to
        verification."""
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        row = 0
        for _, d in sampling:
            n = 1 if d is None else d.num + 1
            (plain_rows if d is None else spec_rows).extend(range(row, row + n))
            row += n
        plain = [seq for seq, d in sampling if d is None]
        spec = [(seq, d) for seq, d in sampling if d is not None]
        plain_tokens, plain_lps = self.sampler(logits[plain_rows], plain) if plain else ([], None)
        verified = iter(verify(logits[spec_rows], [seq for seq, _ in spec], [d for _, d in spec]))
        next_token, next_lp = iter(plain_tokens), iter(plain_lps or [None] * len(plain))
        tokens: list[int] = []
        accepted: list[tuple[int, ...]] = []
        logprobs: list[LogprobEntry | None] = []
        for _, d in sampling:
            if d is None:
                tokens.append(next(next_token))
                accepted.append(())
                logprobs.append(next(next_lp))
            else:
                kept, token = next(verified)
                tokens.append(token)
                accepted.append(kept)
                logprobs.append(None)
        return StepOutput(tokens, accepted,
                          logprobs if any(e is not None for e in logprobs) else None)

    def _one_by_one(self, logits: torch.Tensor,
                    sampling: list[tuple[Sequence, Drafts | None]]) -> StepOutput:
        """Sample or verify each sequence alone, so that only the requests at fault fail. Neither
        the sampler nor verification writes the logits it is given: this second try sees them as the
        forward left them."""
        tokens: list[int] = []
        accepted: list[tuple[int, ...]] = []
        logprobs: list[LogprobEntry | None] = []
        errors: dict[int, str] = {}
        row = 0
        for j, (seq, d) in enumerate(sampling):
            n = 1 if d is None else d.num + 1
            rows = logits[row:row + n]  # [n, V]
            row += n
            token: int = -1
            kept: tuple[int, ...] = ()
            entry: LogprobEntry | None = None
            try:
                if d is None:
                    sampled, lps = self.sampler(rows, [seq])
                    token, entry = sampled[0], lps[0] if lps else None
                else:
                    kept, token = verify(rows, [seq], [d])[0]
            except Exception as e:
                errors[j] = f"{type(e).__name__}: {e}"
            tokens.append(token)
            accepted.append(kept)
            logprobs.append(entry)
        spec = any(d is not None for _, d in sampling)
        return StepOutput(tokens, accepted if spec else None,
                          logprobs if any(e is not None for e in logprobs) else None, errors)

    def close(self) -> None:
        """Nothing to stop here; TPRunner stops its workers."""

    def _swap(self, plan: StepPlan) -> None:
        move_blocks(self.backend, self.kv_cache, plan.swap_out, plan.swap_in, plan.copies)

    def _forward(self, batch: Batch) -> torch.Tensor:
        """-> logits [rows, V]: one forward of the model (tensor parallelism runs it on every
        rank)."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch)
        return batch.forward(self.model, self.kv_cache.device, self.backend, self.device)

    def _forward_hidden(self, batch: Batch, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [rows, V], the final hidden states of `rows`): one forward for sampled and
        pooled (embedding) rows (tensor parallelism runs it on every rank)."""
        model = cast("LlamaForCausalLM", self.model)
        return batch.forward_hidden(model, self.kv_cache.device, self.backend, self.device, rows)


def move_blocks(backend: AttentionBackend, kv: KVCache, swap_out: list[tuple[int, int]],
                swap_in: list[tuple[int, int]], copies: list[tuple[int, int]]) -> None:
    """Out before in: a block swapped out this step may be the very block another request swaps
    into."""
    for pairs, src, dst in ((swap_out, kv.device, kv.cpu), (swap_in, kv.cpu, kv.device)):
        if pairs:
            ids = torch.tensor(pairs, dtype=torch.int64)  # [N, 2] (src block, dst block)
            backend.swap_blocks(src, dst, ids[:, 0], ids[:, 1])
    if copies:  # copy-on-write, after the swaps: a copy's source may just have been swapped in
        ids = torch.tensor(copies, dtype=torch.int64)  # [N, 2] (shared block, its new copy)
        backend.copy_blocks(kv.device, ids[:, 0], ids[:, 1])
