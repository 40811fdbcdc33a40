"""PyTorch attention over the paged KV cache: the CPU path and the oracle for the Triton kernels.

Each step's calls are planned once (kernels/torch_plan.py). With native=True (`--attention-backend
cpu`, the default on CPUs) decodes and short queries, and where it pays every prompt chunk too, go
to the native kernel of kernels/cpu, which reads K/V blocks where they lie; the rest runs SDPA.
Batched calls gather whole blocks into a workspace reused across layers and steps, because a fresh
tensor of tens of MB is mapped and page-faulted in on every call. Grouped-query heads ride in
SDPA's query length: q [B, Hkv, Q * G, D] against k [B, Hkv, L, D], so K/V are never expanded to
all heads. What each of these choices measured: docs/performance.md, "CPU attention".
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from kernels.backend import BatchLayout
from kernels.torch_plan import Batched, TorchMeta, plan

# slot_mapping, block_tables, q_start, q_len, seq_len, part_tokens, isa (TorchBackend.native_step)
NativeStep = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, str]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool, scale: float, gqa: bool, softcap: float | None) -> torch.Tensor:
    """SDPA, or where scores are soft-capped (Gemma 2: cap * tanh(s / cap) before the mask) the same
    attention written out, in transformers' order of operations, with the softmax in float32. q [B,
    H, Lq, D], k/v [B, Hkv, Lk, D], mask bool (True = visible) or additive -> [B, H, Lq, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=gqa)
    if gqa:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)).float() * scale  # [B, H, Lq, Lk]
    s = torch.tanh(s / softcap) * softcap
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool,
                          device=s.device).tril(s.shape[-1] - s.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.softmax(s, dim=-1).to(v.dtype) @ v


class TorchBackend:
    # Sliding windows and soft-capped scores are honoured per call (Gemma 2/3, Mistral, Phi-3).
    supports_window = True
    supports_softcap = True
    # K/V may be stored in bfloat16 under a float32 model: stores cast down; decode and short
    # queries attend in the cache's dtype (half the bytes to gather and read); prompt chunks, bound
    # by arithmetic, upcast.
    casts_kv = True

    # Context tokens per task of the native kernel: a long sequence is split so both cores share it.
    NATIVE_PART_TOKENS = 256

    def __init__(self, device: torch.device | str = "cpu", native: bool = False,
                 native_max_context: int | None = None, dtype: torch.dtype | None = None,
                 native_prompts: bool | None = None) -> None:
        """native: decodes and short queries through the native CPU kernel, where it builds
        (kernels.cpu).
        native_max_context: the most context tokens a step's short queries may attend for the native
        kernel to take them; None (the default): no limit. The kernel beats gather + SDPA at every
        batch and context measured, in bfloat16 and float32, on AVX-512 and AVX2 CPUs (python
        bench/cpu_attention.py --native); the knob stays for bench/step_profile.py
        --native-max-context, to time the old path beside it.
        dtype: the model's, where known: prompt chunks go native where that pays (below).
        native_prompts: True puts prompt chunks on the native kernel wherever it runs
        (--deterministic); None decides as below."""
        self.device = torch.device(device)
        self.native_max_context = native_max_context
        # The native kernel's code path: auto (the best this CPU runs) or portable | avx2 | avx512 |
        # avx512_bf16 (docs/kernels.md); CONVEYOR_ATTENTION_ISA names one for a bench's side-by-side
        # run.
        self.native_isa = os.environ.get("CONVEYOR_ATTENTION_ISA", "auto")
        self._workspace = torch.empty(0, device=self.device)  # gathered K then V, grown as needed
        if native and self.device.type == "cpu":
            from kernels import cpu

            native = cpu.available()
        self.native = native and self.device.type == "cpu"
        # Prompt chunks through the native kernel too, where it beats SDPA (bench/cpu_attention.py
        # --native): with its AVX-512 BF16 path, i.e. a bfloat16 model and cache on a CPU with
        # avx512_bf16. (With AMX, SDPA's flash kernel runs a lone prompt 3-4x faster, but served
        # steps mix prompt chunks with decodes, and there the one native call per step served more:
        # docs/performance.md, "The AMX Xeon".) One kernel for every row walks each row's context in
        # one fixed order, so a token's output does not depend on how its prompt was chunked or
        # cached (docs/determinism.md); --deterministic asks for it wherever the native kernel runs.
        # CONVEYOR_NATIVE_PROMPTS=1|0 forces it on or off. Asked only where the native kernel runs:
        # elsewhere (CUDA, the torch backend) its library may not be loaded at all.
        forced = os.environ.get("CONVEYOR_NATIVE_PROMPTS")
        if not self.native:
            self.native_prompts = False
        elif native_prompts is not None:
            self.native_prompts = native_prompts
        elif forced in ("0", "1"):
            self.native_prompts = forced == "1"
        else:
            self.native_prompts = self._bf16_path(dtype)

    def _bf16_path(self, dtype: torch.dtype | None) -> bool:
        """Whether the native kernel runs its AVX-512 BF16 path for this model (head dim aside)."""
        return (dtype == torch.bfloat16 and self.native_isa in ("auto", "avx512_bf16", "amx")
                and "avx512_bf16" in torch.ops.conveyor_cpu.attention_isas())

    def plan(self, layout: BatchLayout) -> TorchMeta:
        return plan(layout, self.device, self.native, self.native_prompts, self.native_max_context)

    def native_step(self, meta: TorchMeta) -> NativeStep | None:
        """The plan's arguments for write_and_attend (as forward passes them, without a window or
        soft-capping) where every row of the step goes to the native kernel, so a model can run its
        layers in one native call (engine/models/llama.py); None where some row goes elsewhere."""
        n = meta.native
        if n is None or not n.covers_all:
            return None
        return (meta.slot_mapping, n.block_tables, n.q_start, n.q_len, n.seq_len,
                self.NATIVE_PART_TOKENS, self.native_isa)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchMeta, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        n = meta.native
        if n is not None and n.covers_all and k.dtype == k_cache.dtype:
            # every row on the native kernel: the K/V write and the kernel in one call (the same
            # copy and kernel as below, without about six Python calls a layer between them)
            o: torch.Tensor = torch.ops.conveyor_cpu.write_and_attend(
                q, k, v, k_cache, v_cache, meta.slot_mapping, n.block_tables, n.q_start, n.q_len,
                n.seq_len, scale, self.NATIVE_PART_TOKENS, window or 0, softcap or 0.0,
                self.native_isa)
            return o
        num_blocks, block_size, hkv, d = k_cache.shape
        k_flat = k_cache.view(num_blocks * block_size, hkv, d)  # [S, Hkv, D]
        v_flat = v_cache.view(num_blocks * block_size, hkv, d)
        # cast only for a bfloat16 cache under a float32 model: a no-op .to() still costs a call
        if k.dtype != k_cache.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        if meta.all_decode:
            return self._attend_batched(q, k_cache, v_cache, meta.batched[0], scale, True, window,
                                        softcap)
        out = q.new_empty(q.shape)
        if n is not None:
            torch.ops.conveyor_cpu.paged_attention(
                out, q, k_cache, v_cache, n.block_tables, n.q_start, n.q_len, n.seq_len, scale,
                self.NATIVE_PART_TOKENS, window or 0, softcap or 0.0, self.native_isa)
            if n.covers_all:
                return out
        for b in meta.batched:
            # [B * q_len, H, D]
            o = self._attend_batched(q, k_cache, v_cache, b, scale, False, window, softcap)
            if b.keep is None:
                out[b.rows] = o
            else:
                out[b.rows[b.keep]] = o[b.keep]
        gqa = q.shape[1] != hkv
        for p in meta.prefills:
            # 4-D [1, H, L, D]: 3-D inputs take SDPA's slow fallback on CPU (docs/performance.md).
            qp = q[p.token_slice].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            # [1, Hkv, L, D]
            kp = k_flat.index_select(0, p.key_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            vp = v_flat.index_select(0, p.key_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
            mask = p.mask_for(window)
            op = attention(qp, kp, vp, mask, mask is None, scale, gqa, softcap)
            out[p.token_slice] = op[0].transpose(0, 1)
        return out

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V blocks [n, block_size, Hkv, D] each, copied into the reused workspace."""
        shape = (blocks.numel(), *k_cache.shape[1:])
        numel = math.prod(shape)
        if self._workspace.numel() < 2 * numel or self._workspace.dtype != k_cache.dtype:
            self._workspace = torch.empty(2 * numel, dtype=k_cache.dtype, device=k_cache.device)
        kb = torch.index_select(k_cache, 0, blocks, out=self._workspace[:numel].view(shape))
        vb = torch.index_select(v_cache, 0, blocks,
                                out=self._workspace[numel:2 * numel].view(shape))
        return kb, vb

    def _attend_batched(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        b: Batched, scale: float, in_order: bool, window: int | None,
                        softcap: float | None) -> torch.Tensor:
        """-> [B * q_len, H, D], row r answering query b.rows[r]. in_order: the rows are all of
        q."""
        _, _, hkv, d = k_cache.shape
        h = q.shape[1]
        g, n = h // hkv, b.q_len
        qb = q if in_order else q.index_select(0, b.rows)  # [B * n, H, D]
        bsz = qb.shape[0] // n
        # Query heads grouped by their KV head, queries and groups together in SDPA's query length.
        # [B, Hkv, n * G, D]
        qb = qb.view(bsz, n, hkv, g, d).transpose(1, 2).reshape(bsz, hkv, n * g, d)
        # a bfloat16 cache under a float32 model: attend in the cache's dtype
        qb = qb.to(k_cache.dtype)
        kb, vb = self._gather(k_cache, v_cache, b.blocks)
        kb = kb.view(bsz, -1, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        vb = vb.view(bsz, -1, hkv, d).transpose(1, 2)
        mask = b.mask_for(window)
        if n == 1:
            mask = mask.view(bsz, 1, 1, -1)
        else:
            mask = mask.expand(-1, -1, -1, g, -1).reshape(bsz, 1, n * g, -1)
        o = attention(qb, kb, vb, mask, False, scale, False, softcap)  # [B, Hkv, n * G, D]
        return o.view(bsz, hkv, n, g, d).transpose(1, 2).reshape(bsz * n, h, d).to(q.dtype)

    def copy_blocks(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv[:, :, dst] = kv[:, :, src]

    def swap_blocks(self, src_kv: torch.Tensor, dst_kv: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        dst_kv[:, :, dst.to(dst_kv.device)] = src_kv[:, :, src.to(src_kv.device)].to(dst_kv.device)
