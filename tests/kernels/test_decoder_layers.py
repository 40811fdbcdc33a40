"""The decoder layers in one native call (kernels/cpu/decoder_layers.cpp) against each layer's
Python forward, the reference: the same ops in the same order, so the same bits in the residual
stream and in every K/V row written, at 1, 2, 7 and 32 rows and with a prompt chunk beside
decodes. On the default model as served on AMX CPUs: SmolLM2-135M's GGUF, bfloat16 activations,
int4 projections on the AMX kernel; and as served on AVX-512 BF16 CPUs without AMX: where its int4
kernel keeps up on prompts (engine/kernel_choice.py invariant_by_default), every int4 projection on
that kernel at every row count, else on it below a handover to packed bfloat16 copies."""
from __future__ import annotations

import random

import pytest
import torch

from engine import kernel_choice
from engine.kernel_calibration import AVX512_INVARIANT_RATIO
from engine.load import amx, int4_avx512
from engine.load.quant import Int4Linear
from engine.load.weights import load_model
from engine.models.llama import LlamaForCausalLM
from engine.models.native_stack import INT4_AVX512
from engine.native_stack_choice import native_stack_of
from kernels.backend import BatchLayout
from kernels.torch_backend import TorchBackend
from shared.model_source import ModelSource
from tests.conftest import causal_lm

BLOCK, BLOCKS = 16, 640
HANDOVER = 7  # the rows from which the handover case's projections take their packed copies


@pytest.fixture(scope="module", params=["amx", "avx512", pytest.param("avx512-handover",
                                                                      marks=pytest.mark.slow)])
def model(smollm2_source: ModelSource, request: pytest.FixtureRequest) -> LlamaForCausalLM:
    """The default model as loaded on AMX CPUs, or as on AVX-512 BF16 CPUs without AMX: with its
    int4 kernel timed within AVX512_INVARIANT_RATIO of the packed copies (pinned here), or past it,
    the copies then taking over from HANDOVER rows (pinned: between the tests' row counts)."""
    handover = request.param == "avx512-handover"
    if request.param == "amx":
        if not amx.usable():
            pytest.skip("no AMX tiles (or native kernels) here")
        loaded, _ = load_model(smollm2_source, torch.bfloat16, "cpu", "int4")
    else:
        if not int4_avx512.usable():
            pytest.skip("this CPU lacks avx512_bf16 (or native kernels)")
        ratio = 2 * AVX512_INVARIANT_RATIO if handover else AVX512_INVARIANT_RATIO
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernel_choice, "cpu_kind", lambda: "AVX512_BF16")
            mp.setattr(amx, "usable", lambda: False)
            mp.setattr(kernel_choice, "prompt_ratio", lambda modules: ratio)
            mp.setattr(kernel_choice, "calibrate", lambda modules, rows=(), reps=3: HANDOVER)
            loaded, _ = load_model(smollm2_source, torch.bfloat16, "cpu", "int4")
    lm = causal_lm(loaded)
    assert lm.native_stack is not None, "the default model there is the native call's case"
    if request.param.startswith("avx512"):  # each projection: its kind, packed_from, plain_from
        each = [INT4_AVX512, HANDOVER if handover else -1, -1]
        assert lm.native_stack.projections == each * 4 * len(lm.model.layers)
    return lm


def layout(query_lens: list[int], context_lens: list[int], seed: int) -> BatchLayout:
    """Sequences over scrambled blocks of the cache; each new token's slot after its context."""
    rng = random.Random(seed)
    free = rng.sample(range(BLOCKS), BLOCKS)
    tables, slots = [], []
    for q, c in zip(query_lens, context_lens):
        tables.append([free.pop() for _ in range((q + c + BLOCK - 1) // BLOCK)])
        slots += [tables[-1][p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + q)]
    return BatchLayout(query_lens, context_lens, tables, BLOCK, torch.tensor(slots))


def forward(model: LlamaForCausalLM, backend: TorchBackend, lay: BatchLayout,
            kv: torch.Tensor, native: bool) -> torch.Tensor:
    """The residual stream after the last layer, for random tokens, with the layers in one native
    call or each through its Python forward."""
    gen = torch.Generator().manual_seed(len(lay.query_lens))
    ids = torch.randint(3, model.config.vocab_size, (sum(lay.query_lens),), generator=gen)
    positions = torch.cat([torch.arange(c, c + q)
                           for q, c in zip(lay.query_lens, lay.context_lens)])
    meta = backend.plan(lay)
    assert backend.native_step(meta) is not None, "every row on the native kernel"
    stack = model.native_stack
    if not native:
        model.native_stack = None
    try:
        with torch.inference_mode():
            return model.hidden_states(ids, positions, kv, meta, backend)
    finally:
        model.native_stack = stack


@pytest.mark.parametrize("query_lens", [[1], [1, 1], [1] * 7, [1] * 32, [1, 1, 37, 1]],
                         ids=["1", "2", "7", "32", "prompt-chunk"])
def test_one_native_call_equals_the_python_layers(model: LlamaForCausalLM,
                                                   query_lens: list[int]) -> None:
    """Bit for bit: the hidden states, and the cache (K/V rows written, nothing else touched).
    Contexts up to 300 tokens: a sequence takes one or two of the kernel's 256-token tasks."""
    cfg = model.config
    contexts = [random.Random(i).randrange(0, 300) for i in range(len(query_lens))]
    lay = layout(query_lens, contexts, seed=len(query_lens))
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(cfg.num_layers, 2, BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                     generator=gen).to(torch.bfloat16)  # earlier tokens' K/V, as random values
    backend = TorchBackend("cpu", native=True, dtype=torch.bfloat16, native_prompts=True)
    kv_python = kv.clone()
    want = forward(model, backend, lay, kv_python, native=False)
    got = forward(model, backend, lay, kv, native=True)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(kv, kv_python)


def test_steps_the_native_call_does_not_take_run_the_python_layers(
        model: LlamaForCausalLM) -> None:
    """A prompt chunk on SDPA (not every row native): the plan has no native step, and the
    forward runs each layer in Python as before."""
    lay = layout([1, 40], [30, 0], seed=1)
    backend = TorchBackend("cpu", native=True, dtype=torch.bfloat16, native_prompts=False)
    assert backend.native_step(backend.plan(lay)) is None


def test_a_layer_off_the_amx_kernel_keeps_every_layer_in_python(model: LlamaForCausalLM) -> None:
    """One projection that would take another kernel at some row count (here torch's int kernel
    below two rows) and the model has no native stack: the call would multiply it on the wrong
    kernel."""
    down = model.model.layers[3].down_proj
    assert isinstance(down, Int4Linear)
    saved, down.amx_from = down.amx_from, 2
    try:
        assert native_stack_of(model) is None
    finally:
        down.amx_from = saved
    assert native_stack_of(model) is not None
