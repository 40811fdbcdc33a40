"""One model graph at every tensor-parallel size: TP=2 equal to TP=1 (float32, greedy, token for token)
for the switches of engine/models/llama.py that the Llama checkpoints of test_tensor_parallel.py leave
off, and for int8 weights. Each test is the reason its refusal in engine/distributed/shard.py is lifted."""
from __future__ import annotations

import torch

from engine.load.quant import Int8Linear


def test_int8_column_slices_with_the_whole_rows_absmax_are_the_whole_matrix_codes():
    """A row-parallel rank holds some columns of each row; with the rows' absmax over all columns (an
    all-reduce at load) its codes and scales are exactly the unsplit matrix's."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    whole = Int8Linear(w, None, torch.float32)
    absmax = w.abs().amax(dim=1)
    for cols in (slice(0, 32), slice(32, 64)):
        part = Int8Linear(w[:, cols], None, torch.float32, absmax)
        assert torch.equal(part.qweight, whole.qweight[:, cols])
        assert torch.equal(part.scales, whole.scales)
