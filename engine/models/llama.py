"""The decoder families: Llama, Mistral, SmolLM2, Qwen2 (a q/k/v bias), Qwen3 (q/k norms), Phi-3
(fused checkpoint weights, LongRoPE), Gemma 2 and 3 (GeGLU, sandwich norms, soft-capping,
sliding-window layers) and Qwen3-MoE (engine/models/moe.py). One graph with switches read from
ModelConfig: the families differ in a handful of places, each a line or two below, and one graph
keeps one fast path for all of them.

Input is one flattened varlen batch with no batch dim: every sequence's new tokens, concatenated
(T rows). Attention goes only through the backend, which also writes K/V into the paged cache.

Choices made for CPU speed, where one decode step reads every weight once and Python overhead
per layer is visible:
- q/k/v and gate/up are one GEMM each (fused when the weights are converted,
  engine/models/convert.py).
- q and k rows are kept in the interleaved RoPE layout (engine/models/rope.py), so RoPE is a single
  complex multiply; only the K stored in the KV cache is in that order.
- o_proj and down_proj add the residual inside the GEMM (addmm); the final norm and the LM head run
  only on the rows that sample (logits_rows), which is most of a short prompt's prefill cost.
- A quantized projection (engine/load/quant.py) replaces an nn.Linear and is called instead of
  F.linear (its add_to used where it has one); so does a tensor-parallel row-parallel one
  (engine/distributed/layers.py).
- Where every layer is the CPU default's common case (NativeStack), all layers run in one native
  call (kernels/cpu/decoder_layers.cpp): the same ops as DecoderLayer.forward, without the Python
  between them (a quarter of a one-row step).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.convert import convert_hf_weights
from engine.models.moe import MoE
from engine.models.native_stack import NativeStack, run_stack
from engine.models.rope import Rotation, apply_rope, rope_table, rotation, to_interleaved
from kernels.backend import AttentionBackend

__all__ = ["DecoderLayer", "LlamaForCausalLM", "linear", "to_interleaved"]


def linear(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    """x @ W.T (+ b) for an nn.Linear or a packed or quantized stand-in. Its forward is called
    directly: nn.Module.__call__'s hook checks cost more than a one-row GEMM's Python (no
    hooks are used here)."""
    if isinstance(m, nn.Linear):
        return F.linear(x, m.weight, m.bias)
    out: torch.Tensor = m.forward(x)
    return out


def add_linear(h: torch.Tensor, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    """h + linear(x, m), the residual added inside the GEMM when the weight is a plain matrix."""
    if isinstance(m, nn.Linear):
        h = torch.addmm(h, x, m.weight.t())
        return h if m.bias is None else h.add_(m.bias)
    # a prepacked matrix fuses the add too (engine/load/prepack.py)
    add_to = getattr(m, "add_to", None)
    if add_to is not None:
        out: torch.Tensor = add_to(h, x)
        return out
    return h + linear(x, m)


def rms(x: torch.Tensor, norm: nn.RMSNorm, native: bool = False) -> torch.Tensor:
    """native: one pass of kernels/cpu/layer_ops.cpp for a [T, E] x (F.rms_norm is ten
    ATen calls on the CPU)."""
    if native:
        out: torch.Tensor = torch.ops.conveyor_cpu.rms_norm(x, norm.weight, norm.eps)
        return out
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.eps)


def mlp_act(gate_up: torch.Tensor, gelu: bool, native: bool = False) -> torch.Tensor:
    """[T, 2I] (gate | up, the fused GEMM's output) -> act(gate) * up [T, I]. native: SiLU x up
    in one pass of kernels/cpu/layer_ops.cpp (F.silu's values; two ATen ops and two passes
    otherwise)."""
    if native and not gelu:
        out: torch.Tensor = torch.ops.conveyor_cpu.silu_and_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=1)  # [T, I] each, views of one [T, 2I]
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)).mul_(up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.qk_size = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.window = cfg.window(index)  # tokens this layer attends back, None = all
        self.softcap = cfg.attn_softcap
        self.local_rope = self.window is not None and cfg.local_rope_theta is not None
        self.gelu = cfg.hidden_act == "gelu_tanh"
        # norms, RoPE and SiLU x up through the native CPU ops (LlamaForCausalLM.use_native_ops)
        self.native = False
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        qkv_size = self.qk_size + cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = nn.RMSNorm(hidden, eps)
        self.qkv_proj = nn.Linear(hidden, qkv_size, bias=cfg.attention_bias)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps) if cfg.qk_norm else None
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, hidden, bias=cfg.o_proj_bias)
        # Llama: the norm before the MLP. Gemma: the norm of the attention output
        # (pre_feedforward_layernorm is then the norm before the MLP and post_feedforward_layernorm
        # the norm of its output).
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(hidden, eps) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = nn.RMSNorm(hidden, eps) if cfg.sandwich_norms else None
        self.moe = MoE(cfg) if index in cfg.sparse_layers else None
        if self.moe is None:
            self.gate_up_proj = nn.Linear(hidden, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, hidden, bias=False)

    def plain_on_native_ops(self) -> bool:
        """A plain Llama layer (no window, soft-capping, q/k norm, GeGLU, MoE or sandwich norms) on
        the native small ops: the only layer the one native call for all layers runs
        (NativeStack)."""
        return (self.native and self.window is None and self.softcap is None and self.q_norm is None
                and not self.gelu and self.moe is None and self.pre_feedforward_layernorm is None)

    def forward(
        self, h: torch.Tensor, rope: Rotation, k_cache: torch.Tensor, v_cache: torch.Tensor,
        attn_meta: object, backend: AttentionBackend,
    ) -> torch.Tensor:
        """h: [T, E] residual stream -> [T, E]. Calls F.* directly: module calls cost microseconds
        each."""
        T, H, Hkv, D = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        native = self.native
        x = rms(h, self.input_layernorm, native)  # [T, E]
        qkv = linear(x, self.qkv_proj)  # [T, (H + 2Hkv) * D]
        # one call for both views (Tensor.split is a Python wrapper around this op)
        qk_flat, v_flat = qkv.split_with_sizes((self.qk_size, Hkv * D), dim=1)
        qk = qk_flat.view(T, H + Hkv, D)
        # per-head norms (weights in interleaved order)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((rms(qk[:, :H], self.q_norm), rms(qk[:, H:], self.k_norm)), dim=1)
        qk = apply_rope(qk, rope)  # [T, H + Hkv, D]
        # q, k, v are row-strided views (stride(1) == D, stride(2) == 1), not T-contiguous copies.
        q, k = qk.split_with_sizes((H, Hkv), dim=1)  # [T, H, D], [T, Hkv, D]
        v = v_flat.view(T, Hkv, D)  # [T, Hkv, D]
        if self.window is None and self.softcap is None:
            o = backend.forward(q, k, v, k_cache, v_cache, attn_meta, self.scale)  # [T, H, D]
        else:
            o = backend.forward(q, k, v, k_cache, v_cache, attn_meta, self.scale,
                                window=self.window, softcap=self.softcap)
        o = o.reshape(T, H * D)
        if self.pre_feedforward_layernorm is None:
            h = add_linear(h, o, self.o_proj)  # h + o_proj(o): [T, E]
            x = rms(h, self.post_attention_layernorm, native)
        else:  # Gemma: norm the attention output before the residual add, and the MLP's input
            h = h + rms(linear(o, self.o_proj), self.post_attention_layernorm, native)
            x = rms(h, self.pre_feedforward_layernorm, native)
        if self.moe is not None:
            moe_out: torch.Tensor = self.moe(x)
            return h + moe_out
        act = mlp_act(linear(x, self.gate_up_proj), self.gelu, native)  # [T, 2I] -> [T, I]
        if self.post_feedforward_layernorm is None:
            return add_linear(h, act, self.down_proj)  # h + down_proj(act): [T, E]
        return h + rms(linear(act, self.down_proj), self.post_feedforward_layernorm, native)


class LlamaModel(nn.Module):
    """Holds the parameters under HF's names (model.embed_tokens, model.layers.N, model.norm).
    They are not meaningfully initialised: the model is built on meta and engine/load/weights.py
    assigns real tensors."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # _weight skips the normal_() init, whose first call on meta costs ~1.5 s of lazy imports.
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.native_ops = False  # the final norm and RoPE through the native CPU ops


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        # Tied models have no lm_head parameter at all: forward uses the embedding, and loading
        # stays strict.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size,
                                                                      cfg.vocab_size, bias=False)
        self.rope: torch.Tensor  # [P, D/2, 2] float32, a buffer: moves with .to(), not saved
        self.register_buffer("rope", rope_table(cfg), persistent=False)
        # the sliding layers' table where their RoPE base differs
        self.rope_local: torch.Tensor | None
        local = rope_table(cfg, cfg.local_rope_theta) if cfg.local_rope_theta is not None else None
        self.register_buffer("rope_local", local, persistent=False)
        # the decoder layers in one native call, set by loading once it has chosen the GEMMs'
        # kernels (engine/native_stack_choice.py native_stack_of); None: each layer's forward
        self.native_stack: NativeStack | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """-> [T, E]. The embedding may be quantized (engine/load/quant.py), then it is a module to
        call."""
        m = self.model
        emb = m.embed_tokens
        if isinstance(emb, nn.Embedding):
            h = F.embedding(input_ids, emb.weight)
        else:
            h = emb.rows(input_ids)
        if self.config.embed_scale is not None:  # Gemma, in the model's dtype as transformers does
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        return h

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, all sequences' new tokens, concatenated
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, Hkv, D]
        attn_meta: object,  # backend.plan(layout), shared by all layers
        backend: AttentionBackend,
        logits_rows: torch.Tensor,  # [B] int64 rows of h whose next token is sampled
    ) -> torch.Tensor:  # [B, vocab] float32
        h = self.hidden_states(input_ids, positions, kv_cache, attn_meta, backend)
        return self.logits(self.final_norm(h[logits_rows]))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: torch.Tensor, attn_meta: object,
                      backend: AttentionBackend) -> torch.Tensor:
        """-> [T, E] the residual stream after the last layer, before the final norm (forward's
        args)."""
        m = self.model
        h = self.embed(input_ids)  # [T, E]
        native = self.model.native_ops
        # every layer in one native call where the model and the step allow it (NativeStack)
        stack = self.native_stack
        plan = getattr(backend, "native_step", None)
        step = plan(attn_meta) if stack is not None and plan is not None else None
        if stack is not None and step is not None and kv_cache.dtype == h.dtype:
            return run_stack(stack, h, kv_cache, self.rope, positions, step)
        rope = rotation(self.rope, positions, native)
        local = rope if self.rope_local is None else rotation(self.rope_local, positions, native)
        # every layer's K and V caches [num_blocks, block_size, Hkv, D] as views made in two
        # calls, not two indexing calls per layer; forward called directly: nn.Module.__call__'s
        # hook checks cost microseconds a layer (no hooks are used here)
        for layer, k, v in zip(m.layers, kv_cache[:, 0], kv_cache[:, 1]):
            h = layer.forward(h, local if layer.local_rope else rope, k, v, attn_meta, backend)
        return h

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """[B, E] -> [B, E]: the model's last hidden states, what the LM head and embeddings
        read."""
        return rms(h, self.model.norm, self.model.native_ops)

    def use_native_ops(self) -> None:
        """Norms, RoPE and SiLU x up through kernels/cpu/layer_ops.cpp: for a CPU model in
        float32 or bfloat16 whose native library is loaded (engine/load/weights.py decides)."""
        self.model.native_ops = True
        for layer in self.model.layers:
            if isinstance(layer, DecoderLayer):
                layer.native = True

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, E] normed hidden states -> [B, V] float32 logits."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        plain = isinstance(head, (nn.Linear, nn.Embedding))
        logits = (F.linear(h, head.weight) if plain else head(h)).float()  # [B, V]
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def convert_hf_weights(self,
                           weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return convert_hf_weights(self.config, weights)
