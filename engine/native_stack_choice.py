"""Whether a model's decoder layers run in one native call (engine/models/native_stack.py), decided
once loading has chosen each projection's kernels (engine/kernel_choice.py): the call must take,
for every projection, the kernel its module's forward takes at each row count, or the bits would
differ from the Python layers'."""
from __future__ import annotations

import torch
from torch import nn

from engine.load import amx
from engine.load.prepack import PackedLinear
from engine.load.quant import Int4Linear
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.models.native_stack import (
    INT4_AMX,
    INT4_AVX2,
    INT4_AVX512,
    PACKED,
    NativeStack,
    Projection,
)

# The projection kinds (engine/models/native_stack.py) the native call takes, by the model's dtype:
# what each dtype's default runs and tests/kernels/test_decoder_layers*.py compare with the Python.
STACK_KINDS = {torch.bfloat16: frozenset({INT4_AMX, INT4_AVX512}),
               torch.float32: frozenset({PACKED, INT4_AVX2})}


def _tiles(m: nn.Module) -> Projection | None:
    """An int4 projection's AMX codes, scales and min_exponent where its forward takes the AMX
    kernel at every row count and has no bias (the quantized default on AMX CPUs), or its codes
    and scales where it takes the AVX-512 BF16 kernel from one row (AVX512_BF16 CPUs), with the
    packed copy it hands over to where it has one, so the native call takes the kernel its
    forward takes; else None."""
    if type(m) is not Int4Linear:  # not a wrapper's subclass
        return None
    codes, scale_zero = m.tile_codes, m.tile_scale_zero
    if codes is None or scale_zero is None or m.amx_from > 1 or m.bias is not None:
        return None
    if m.tiles_avx512:
        return _with_copy(m, INT4_AVX512, [codes, scale_zero], [])
    if m.packed is not None:
        return None
    return Projection(INT4_AMX, [codes, scale_zero], [m.tile_min_exponent, amx.ROWS_PATH_MAX])


def _with_copy(m: Int4Linear, kind: int, tensors: list[torch.Tensor],
               ints: list[int]) -> Projection | None:
    """A kernel's projection (its tensors, then its ints) followed by its packed copy's, which
    QuantizedLinear.mm takes from packed_from rows (_packed's case; packed_from -1 and the kernel's
    tensors again where there is no copy); None where the copy is not one the native call takes."""
    if m.packed is None:
        return Projection(kind, [*tensors, *tensors], [*ints, -1, -1])
    copy = _packed(m.packed)
    if copy is None:
        return None
    return Projection(kind, [*tensors, *copy.tensors], [*ints, m.packed_from, *copy.ints])


def _packed(m: nn.Module) -> Projection | None:
    """A prepacked projection without bias whose calls are neither padded nor cut
    (--deterministic): its forward takes oneDNN's packed matrix, and MKL on the plain one from
    plain_from rows, as the native call then does; else None."""
    if (type(m) is not PackedLinear or m.bias is not None or m.pad_one_row
            or m.max_rows is not None):
        return None
    plain_from = -1 if m.plain is None or m.plain_from is None else m.plain_from
    return Projection(PACKED, [m.packed, m.packed if m.plain is None else m.plain], [plain_from])


def _int4_avx2(m: nn.Module) -> Projection | None:
    """An int4 projection on the AVX2 kernel (float32) from one row, without bias, whose packed
    float32 copy, where it has one, is _packed's case: QuantizedLinear.mm takes the copy from
    packed_from rows and the kernel below, as the native call then does; else None."""
    if (type(m) is not Int4Linear or m.avx2_scale_low is None or m.bias is not None
            or m.amx_from > 1):
        return None
    return _with_copy(m, INT4_AVX2, [m.qweight, m.avx2_scale_low], [8 if m.avx2_q8 else 32])


def native_stack_of(model: LlamaForCausalLM) -> NativeStack | None:
    """Every decoder layer in one native call (engine/models/native_stack.py), where each layer is
    plain on the native small ops with norms of one eps in the model's dtype, every projection is
    one of STACK_KINDS' for that dtype and the layers share their settings; else None. Called
    once the kernels are chosen."""
    weights: list[torch.Tensor] = []
    projections: list[int] = []
    settings = set()
    for layer in model.model.layers:
        if not isinstance(layer, DecoderLayer) or not layer.plain_on_native_ops():
            return None
        norm, post = layer.input_layernorm, layer.post_attention_layernorm
        kinds = STACK_KINDS.get(norm.weight.dtype, frozenset())
        projs = [_tiles(m) or _packed(m) or _int4_avx2(m)
                 for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        present = [p for p in projs if p is not None and p.kind in kinds]
        if (norm.eps is None or post.eps != norm.eps or len(present) != len(projs)
                or post.weight.dtype != norm.weight.dtype):
            return None
        qkv, o, gate_up, down = present
        weights += [norm.weight, *qkv.tensors, *o.tensors, post.weight, *gate_up.tensors,
                    *down.tensors]
        projections += [n for p in present for n in (p.kind, *p.ints)]
        settings.add((layer.num_heads, layer.num_kv_heads, norm.eps, layer.scale))
    if len(settings) != 1:
        return None
    heads, kv_heads, eps, scale = settings.pop()
    return NativeStack(weights, projections, heads, kv_heads, eps, scale)
