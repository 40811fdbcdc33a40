"""Triton kernels over the paged KV cache (GPU; on CPU only under TRITON_INTERPRET=1, for tests).

Each module holds the @triton.jit kernels and a launcher that asserts shapes, dtypes and strides
before launching. kernels/triton_backend.py strings them together behind the AttentionBackend
Protocol; the PyTorch backend is the oracle they are tested against.
"""
from kernels.triton.cache_ops import copy_blocks, move_blocks, store_kv, swap_in, swap_out
from kernels.triton.decode import decode_attention, decode_block_n
from kernels.triton.prefill import (
    device_arch,
    prefill_attention,
    prefill_block_q,
    prefill_knobs,
    prefill_tiles,
)

__all__ = [
    "copy_blocks", "decode_attention", "decode_block_n", "device_arch", "move_blocks",
    "prefill_attention", "prefill_block_q", "prefill_knobs", "prefill_tiles", "store_kv",
    "swap_in", "swap_out",
]
