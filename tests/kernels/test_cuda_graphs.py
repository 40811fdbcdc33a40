"""Decode steps through CUDA graphs' static buffers (engine/cuda_graphs.py) give the tokens of the
eager engine. On CPU the buffers run without capture under TRITON_INTERPRET=1, which checks what
the graphs add (padding to a bucket, slot -1 for padded rows, lengths and tables read from the
buffers); on a CUDA machine the same comparison runs with real capture and replay.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.cuda_graphs import MAX_CAPTURE_SIZE, bucket_sizes
from tests.kernels.triton_worker import run_isolated

# Five sequences finishing at different steps, so decode batches shrink through the buckets with
# padding; prompts across a block boundary, two sharing a cached prefix. The first sequence holds
# block 0 (the first block handed out) and runs longest: a padded row that wrote its K/V into slot
# 0 instead of nowhere would change its logprobs.
PROMPTS = [[(5 * i + 1) % 97 for i in range(3)], [(11 * i + 2) % 97 for i in range(40)],
           [7] * 20 + [9, 10], [7] * 20 + [12], [(13 * i + 5) % 97 for i in range(17)]]
MAX_TOKENS = [12, 3, 5, 7, 9]


def test_bucket_sizes_cover_every_batch_with_little_padding() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and bucket_sizes(256)[-1] == 256
    assert bucket_sizes(10_000)[-1] == MAX_CAPTURE_SIZE
    for top in (1, 7, 16, 100, 256):
        sizes = bucket_sizes(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top
        for n in range(1, top + 1):  # every batch has a bucket, at most 15 rows of padding
            assert next(s for s in sizes if s >= n) - n <= 15


Run = tuple[list[list[int]], list[list[float]], int]


def _generate(model_dir: str, device: str, graphs: str) -> Run:
    """Greedy tokens of PROMPTS; graphs: "off" (eager), "buffers" (the static buffers without
    capture) or "capture" (the engine's own CUDA graphs). -> (tokens, their logprobs, decode steps
    replayed)."""
    from engine.build import capture_decode_graphs
    from engine.core import EngineCore
    from shared.config import build_config
    from shared.protocol import RequestOutput
    from shared.sampling import SamplingParams

    core = EngineCore(build_config(model_dir, device=device, dtype="float32",
                                   attention_backend="triton", max_num_seqs=8,
                                   max_num_batched_tokens=32, kv_cache_memory="64MiB",
                                   enforce_eager=graphs != "capture"))
    runner = core.runner
    if graphs == "buffers":
        runner.graphs = capture_decode_graphs(runner, 8, core.max_model_len, capture=False)
    assert (runner.graphs is None) == (graphs == "off")
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    logprobs: list[list[float]] = [[] for _ in PROMPTS]
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        core.add(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                logprobs=0))
    while core.has_work():
        for o in core.step():
            assert isinstance(o, RequestOutput), o
            tokens[int(o.request_id)] += o.new_token_ids
            logprobs[int(o.request_id)] += [entry[0] for entry in o.logprobs or []]
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return tokens, logprobs, runner.graphs.replays if runner.graphs else 0


def _same(eager: Run, graphed: Run) -> None:
    """The same tokens, and logprobs within float32 rounding: the graphs' decode kernel may split
    a context where the eager one does not, which reorders its sums (a padded row that wrote into
    another sequence's cache would move them by far more)."""
    assert [len(t) for t in eager[0]] == MAX_TOKENS
    assert graphed[2] >= 5, graphed[2]  # the decode-only steps went through the graphs
    assert graphed[0] == eager[0]
    worst = max(abs(a - b) for x, y in zip(eager[1], graphed[1]) for a, b in zip(x, y, strict=True))
    assert worst < 1e-4, worst


def _case_buffers_match_eager(model_dir: str) -> None:
    _same(_generate(model_dir, "cpu", "off"), _generate(model_dir, "cpu", "buffers"))


@pytest.mark.slow
def test_static_buffers_give_the_eager_tokens(tiny_llama_dir: Path) -> None:
    """Padded decode batches read and write only their own rows: the same greedy tokens."""
    run_isolated(_case_buffers_match_eager, model_dir=str(tiny_llama_dir), timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device and the real Triton compiler "
                           "(TRITON_INTERPRET unset)")
def test_captured_graphs_give_the_eager_tokens_on_cuda(tiny_llama_dir: Path) -> None:
    """The engine's own captured graphs (on by default on CUDA) against --enforce-eager."""
    _same(_generate(str(tiny_llama_dir), "cuda", "off"),
          _generate(str(tiny_llama_dir), "cuda", "capture"))
