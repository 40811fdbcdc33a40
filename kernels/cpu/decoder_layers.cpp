// A stack of Llama decoder layers in one call, for the CPU default's common case: bfloat16 activations, every
// projection int4 on the AMX kernel, every row of the step on the native attention kernel, no bias, window,
// soft-capping, q/k norm or MoE (engine/models/llama.py decides; everything else runs its Python layer).
//
// At one decode row a layer's ops are short (a GEMM of one row, a norm of 576 numbers), and the Python
// between them (module lookups, argument parsing, the dispatcher: about 100 us a layer) was a quarter of
// the step. Here each layer runs the very ops the Python layer calls, as C++ functions (ops.h), on the same
// tensors in the same order, so a row's bits are the Python layer's (tests/kernels/test_decoder_layers.py).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "ops.h"

namespace {

// Tensors a layer passes in `weights`, in this order: the input norm's weight; qkv_proj's tile codes and
// scales; o_proj's; the post-attention norm's weight; gate_up_proj's; down_proj's.
constexpr int64_t kTensors = 10;
constexpr int64_t kProjections = 4;  // min_exponents a layer passes: qkv, o, gate_up, down

// The step's attention plan (kernels/torch_plan.py Native) and the kernel's settings.
struct Plan {
  const at::Tensor &slot_mapping, &block_tables, &q_start, &q_len, &seq_len;
  double scale;
  int64_t part_tokens;
  c10::string_view isa;
};

// x @ W.T (+ residual) as engine/load/amx.py int4_mm chooses: the rows path up to rows_path_max rows.
at::Tensor project(const at::Tensor& x, const at::Tensor* w, int64_t min_exponent,
                   const c10::optional<at::Tensor>& residual, int64_t rows_path_max) {
  if (x.size(0) <= rows_path_max) return int4_gemm_rows(x, w[0], w[1], residual, min_exponent);
  return int4_gemm(x, w[0], w[1], residual);
}

// One layer: DecoderLayer.forward's native path, op for op. h [T, E] -> [T, E].
at::Tensor layer(const at::Tensor& h, const at::Tensor* w, const int64_t* exps, const at::Tensor& kv,
                 const at::Tensor& table, const at::Tensor& positions, const Plan& p, int64_t H, int64_t Hkv,
                 double eps, int64_t rows_path_max) {
  const int64_t T = h.size(0), D = kv.size(-1);
  at::Tensor x = conveyor::rms_norm(h, w[0], eps);                           // [T, E]
  at::Tensor qkv = project(x, w + 1, exps[0], c10::nullopt, rows_path_max);  // [T, (H + 2Hkv) * D]
  at::Tensor qk = qkv.narrow(1, 0, (H + Hkv) * D).view({T, H + Hkv, D});
  conveyor::rope_(qk, table, positions);
  at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  at::Tensor o = conveyor::write_and_attend(qk.narrow(1, 0, H), qk.narrow(1, H, Hkv), v, kv.select(0, 0),
                                            kv.select(0, 1), p.slot_mapping, p.block_tables, p.q_start, p.q_len,
                                            p.seq_len, p.scale, p.part_tokens, 0, 0.0, p.isa);  // [T, H, D]
  at::Tensor h2 = project(o.view({T, H * D}), w + 3, exps[1], h, rows_path_max);      // h + o_proj(o)
  x = conveyor::rms_norm(h2, w[5], eps);
  at::Tensor act = conveyor::silu_and_mul(project(x, w + 6, exps[2], c10::nullopt, rows_path_max));  // [T, I]
  return project(act, w + 8, exps[3], h2, rows_path_max);  // h2 + down_proj(act)
}

// h [T, E] bfloat16 through every layer -> [T, E]; kv_cache [layers, 2, blocks, block_size, Hkv, D]; table
// [P, D/2, 2] float32 and positions [T] int64 (rope_'s); rows_path_max: engine/load/amx.py ROWS_PATH_MAX; the
// rest is the step's plan for write_and_attend (TorchBackend.native_step).
at::Tensor decoder_layers(const at::Tensor& h, at::TensorList weights, at::IntArrayRef min_exponents,
                          const at::Tensor& kv_cache, const at::Tensor& table, const at::Tensor& positions,
                          int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t rows_path_max,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& q_start,
                          const at::Tensor& q_len, const at::Tensor& seq_len, int64_t part_tokens, c10::string_view isa) {
  const int64_t layers = kv_cache.size(0);
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2, "decoder_layers: kv_cache [layers, 2, ...]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kTensors, "decoder_layers: ", kTensors,
              " weights a layer");
  TORCH_CHECK(static_cast<int64_t>(min_exponents.size()) == layers * kProjections, "decoder_layers: ", kProjections,
              " min_exponents a layer");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16,
              "decoder_layers: h [T, E] and the cache in bfloat16");
  const Plan plan{slot_mapping, block_tables, q_start, q_len, seq_len, scale, part_tokens, isa};
  at::Tensor out = h;
  for (int64_t l = 0; l < layers; ++l)
    out = layer(out, weights.data() + l * kTensors, min_exponents.data() + l * kProjections, kv_cache.select(0, l),
                table, positions, plan, num_heads, num_kv_heads, eps, rows_path_max);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("decoder_layers(Tensor h, Tensor[] weights, int[] min_exponents, Tensor(a!) kv_cache, Tensor table, "
        "Tensor positions, int num_heads, int num_kv_heads, float eps, float scale, int rows_path_max, "
        "Tensor slot_mapping, Tensor block_tables, Tensor q_start, Tensor q_len, Tensor seq_len, int part_tokens, "
        "str isa='auto') -> Tensor");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &decoder_layers);
}
