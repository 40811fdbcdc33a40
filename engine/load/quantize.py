"""What a quantized load replaces and with what: the projections and the LM head in the mode asked,
the embedding as int8 rows, one float matrix at a time (engine/load/weights.py streams them), and
what the result weighs. The quantized modules themselves live in engine/load/quant.py."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.load.quant import GROUP, LAYER_PROJECTIONS, Int4Linear, Int8Linear
from shared.config import INT4_QUANTIZATIONS

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM


def quantize(linear: nn.Linear | nn.Embedding, mode: str, dtype: torch.dtype,
             groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> nn.Module:
    """One float projection -> its int8 or int4 replacement (int8 where int4 does not apply)."""
    module = quantize_matrix(linear.weight, mode if isinstance(linear, nn.Linear) else "int8",
                             dtype, groups)
    if isinstance(linear, nn.Linear) and linear.bias is not None:
        module.bias = nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
    return module


def quantize_matrix(weight: torch.Tensor, mode: str, dtype: torch.dtype,
                    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
                    absmax: torch.Tensor | None = None) -> Int8Linear | Int4Linear:
    """A float matrix [N, K] -> its int8 or int4 module, without bias (int8 where int4 does
    not apply). absmax: the whole rows' largest |w| for an int8 matrix that is a slice of
    columns (Int8Linear)."""
    if mode in INT4_QUANTIZATIONS and weight.shape[1] % GROUP == 0:
        return Int4Linear(weight, None, dtype, groups, round_x=mode == "w4a8")
    return Int8Linear(weight, None, dtype, absmax)


def quantized_targets(model: LlamaForCausalLM, mode: str) -> dict[str, str]:
    """Module path -> int8 | int4 of what quantization replaces: each decoder layer's
    projections and the LM head in mode, the embedding as int8 rows (see module doc). A tied LM
    head is the embedding."""
    targets = {f"model.layers.{i}.{name}": mode for i, layer in enumerate(model.model.layers)
               for name in LAYER_PROJECTIONS if isinstance(getattr(layer, name, None), nn.Linear)}
    if isinstance(model.lm_head, nn.Linear):
        targets["lm_head"] = mode
    targets["model.embed_tokens"] = "int8"
    return targets


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (quantized codes, scales, norms, RoPE
    tables)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
