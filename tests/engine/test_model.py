"""Our Llama/Qwen2 forward over a paged, varlen batch equals transformers' logits at
every position."""
from __future__ import annotations

import pytest
import torch

from engine.load.weights import load_model
from kernels.backend import BatchLayout
from kernels.torch_backend import TorchBackend
from shared.model_source import resolve_model
from tests.conftest import decoder_layers

BLOCK_SIZE, NUM_BLOCKS = 16, 64


def hf_logits(folder, seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits for each sequence on its own (no padding): [L, V] each."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in seqs]


def scrambled_tables(lens: list[int], seed: int = 0) -> list[list[int]]:
    """Each sequence gets enough blocks, drawn from a shuffled pool: never contiguous,
    never in order."""
    pool = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    return [[pool.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lens]


class Runner:
    """Drives the model the way the engine's runner does: one flattened batch per step
    over one cache."""

    def __init__(self, folder, dtype: torch.dtype = torch.float32) -> None:
        self.model, self.cfg = load_model(resolve_model(str(folder)), dtype, "cpu")
        self.backend = TorchBackend("cpu")
        c = self.cfg
        self.kv = torch.zeros(c.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim,
                              dtype=dtype)

    def step(self, chunks: list[tuple[list[int], int, int]], tables: list[list[int]],
             last_only: bool = False):
        """chunks: (sequence token ids, start, end): compute tokens start..end-1 with start cached.
        -> [rows, V] logits: every new token's, or only each sequence's last."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        for (seq, start, end), table in zip(chunks, tables):
            ids += seq[start:end]
            pos += range(start, end)
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(start, end)]
            rows.append(len(ids) - 1)
        layout = BatchLayout([e - s for _, s, e in chunks], [s for _, s, _ in chunks], tables,
                             BLOCK_SIZE, torch.tensor(slots))
        logits_rows = torch.tensor(rows) if last_only else torch.arange(len(ids))
        with torch.inference_mode():
            return self.model(torch.tensor(ids), torch.tensor(pos), self.kv,
                              self.backend.plan(layout), self.backend, logits_rows)


def random_seqs(lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_varlen_prefill_equals_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    lens = [13, 40, 7]
    seqs = random_seqs(lens, 512)
    run = Runner(folder)
    tables = scrambled_tables(lens)
    ours = run.step([(s, 0, len(s)) for s in seqs], tables)  # [sum(lens), V]
    ref = torch.cat(hf_logits(folder, seqs))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # The LM head on the last rows only gives the same rows (what the engine asks for
    # when sampling).
    last = run.step([(s, 0, len(s)) for s in seqs], tables, last_only=True)
    ends = torch.tensor(lens).cumsum(0) - 1
    torch.testing.assert_close(last, ours[ends], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_cached_prefix_then_rest_equals_transformers(fixture, request):
    """Step 1 prefills prefixes; step 2 (sequences in another order) continues with decodes and a
    prefill chunk over a cached context, reading K/V that step 1 wrote."""
    folder = request.getfixturevalue(fixture)
    lens = [11, 37, 21]
    seqs = random_seqs(lens, 512, seed=1)
    run = Runner(folder)
    tables = scrambled_tables(lens, seed=1)
    prefix = [10, 20, 20]
    run.step([(s, 0, p) for s, p in zip(seqs, prefix)], tables)
    order = [1, 0, 2]  # seq 1: 17 tokens over a cached 20; seqs 0 and 2: one decode token each
    ours = run.step([(seqs[i], prefix[i], lens[i]) for i in order], [tables[i] for i in order])
    ref = hf_logits(folder, seqs)
    torch.testing.assert_close(ours, torch.cat([ref[i][prefix[i]:] for i in order]), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 4.0},
])
def test_rope_scaling_equals_transformers(rope_scaling, tmp_path, make_tiny_checkpoint):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = make_tiny_checkpoint(tmp_path, LlamaConfig, LlamaForCausalLM,
                                  rope_scaling=rope_scaling)
    seqs = random_seqs([90], 512, seed=2)
    ours = Runner(folder).step([(seqs[0], 0, 90)], scrambled_tables([90]))
    torch.testing.assert_close(ours, hf_logits(folder, seqs)[0], atol=1e-4, rtol=1e-4)


def test_bfloat16_close_to_float32(tiny_llama_dir):
    seqs = random_seqs([30], 512, seed=3)
    ref = Runner(tiny_llama_dir).step([(seqs[0], 0, 30)], scrambled_tables([30]))
    run = Runner(tiny_llama_dir, torch.bfloat16)
    ours = run.step([(seqs[0], 0, 30)], scrambled_tables([30]))
    # packed (a buffer) where oneDNN packs bfloat16, else nn.Linear
    qkv = decoder_layers(run.model)[0].qkv_proj
    assert {t.dtype for t in (*qkv.buffers(), *qkv.parameters())} == {torch.bfloat16}
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


def test_tied_embeddings_equal_transformers(tmp_path, make_tiny_checkpoint):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = make_tiny_checkpoint(tmp_path, LlamaConfig, LlamaForCausalLM, tie_word_embeddings=True)
    run = Runner(folder)
    # tied: no head matrix of its own was loaded
    assert not isinstance(run.model.lm_head, torch.nn.Linear)
    seqs = random_seqs([25], 512, seed=4)
    ours = run.step([(seqs[0], 0, 25)], scrambled_tables([25]))
    torch.testing.assert_close(ours, hf_logits(folder, seqs)[0], atol=1e-4, rtol=1e-4)
