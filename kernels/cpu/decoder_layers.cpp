// A stack of Llama decoder layers in one call, for the CPU default's common cases: every projection on one of
// the kernels below (Kind), every row of the step on the native attention kernel, no bias, window,
// soft-capping, q/k norm or MoE (engine/models/llama.py and engine/native_stack_choice.py decide; everything
// else runs its Python layer). bfloat16 with int4 on AMX tiles or on the AVX-512 BF16 kernel, or float32 with
// oneDNN's packed matrices or int4 on the AVX2 kernels.
//
// At one decode row a layer's ops are short (a GEMM of one row, a norm of 576 numbers), and the Python
// between them (module lookups, argument parsing, the dispatcher: about 100 us a layer) was a quarter of
// the step. Here each layer runs the very ops the Python layer calls, as C++ functions (ops.h) or through
// the dispatcher from C++, on the same tensors in the same order, so a row's bits are the Python layer's
// (tests/kernels/test_decoder_layers.py, test_decoder_layers_f32.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

namespace {

// How a projection multiplies, as its Python module's forward does for the call's rows. Each projection is
// described by its kind in `projections`, followed by that kind's ints, and takes that kind's tensors from
// `weights` (engine/native_stack_choice.py writes them in the same order). A new kind: a number here, its
// counts in kTensorsOf / kIntsOf, a case in project, and its writer in native_stack_choice.py.
enum Kind : int64_t {
  // engine/load/amx.py int4_mm: tensors tile codes, scales; ints min_exponent, rows_path_max (the rows
  // path up to that many rows, the tiles above).
  kInt4Amx = 0,
  // engine/load/prepack.py PackedLinear: tensors oneDNN's packed matrix, the plain one (any tensor where
  // unused); ints plain_from (F.linear / addmm on the plain matrix from that many rows; -1: never).
  kPacked = 1,
  // engine/load/int4_avx2.py int4_mm (float32), with a PackedLinear copy from packed_from rows
  // (QuantizedLinear.mm): tensors codes, scale_low, then the copy's two kPacked tensors (any tensors where
  // there is no copy); ints x_bits (8: x rounded to 8 bits, int4_gemm_avx2_q8; 32: int4_gemm_avx2),
  // packed_from (-1: no copy), then the copy's plain_from.
  kInt4Avx2 = 2,
  // engine/load/int4_avx512.py int4_mm (AVX-512 BF16 without AMX), with a PackedLinear copy from packed_from
  // rows as kInt4Avx2's: tensors tile codes, scales, then the copy's two kPacked tensors (any tensors where
  // there is no copy); ints packed_from (-1: no copy, the kernel at every row count), the copy's plain_from.
  kInt4Avx512 = 3,
  kKinds
};
constexpr int64_t kTensorsOf[kKinds] = {2, 2, 4, 4};
constexpr int64_t kIntsOf[kKinds] = {2, 1, 3, 2};
constexpr int64_t kProjections = 4;  // a layer's, in order: qkv, o, gate_up, down

struct Proj {
  int64_t kind;
  const at::Tensor* w;  // kTensorsOf[kind] tensors
  const int64_t* arg;   // kIntsOf[kind] ints
};

// A layer's norms and projections, read off the two lists: per layer its input norm's weight, qkv's
// tensors, o's, the post-attention norm's weight, gate_up's, down's.
struct Layer {
  const at::Tensor *input_norm, *post_norm;
  Proj qkv, o, gate_up, down;
};

// Walks the lists layer by layer, checking each read against their ends.
struct Reader {
  at::TensorList w;
  at::IntArrayRef ints;
  size_t wi = 0, ii = 0;

  const at::Tensor* tensor() {
    TORCH_CHECK(wi < w.size(), "decoder_layers: fewer weights than the projections describe");
    return &w[wi++];
  }
  Proj proj() {
    TORCH_CHECK(ii < ints.size(), "decoder_layers: fewer projections than layers");
    const int64_t kind = ints[ii++];
    TORCH_CHECK(kind >= 0 && kind < kKinds, "decoder_layers: no projection kind ", kind);
    TORCH_CHECK(wi + kTensorsOf[kind] <= w.size() && ii + kIntsOf[kind] <= ints.size(),
                "decoder_layers: a projection's tensors or ints past the lists' end");
    const Proj p{kind, &w[wi], ints.data() + ii};
    wi += kTensorsOf[kind];
    ii += kIntsOf[kind];
    return p;
  }
  Layer layer() {
    Layer l{};
    l.input_norm = tensor();
    l.qkv = proj();
    l.o = proj();
    l.post_norm = tensor();
    l.gate_up = proj();
    l.down = proj();
    return l;
  }
};

// PackedLinear.forward / add_to: oneDNN's packed GEMM through the ops the Python calls
// (mkldnn::_linear_pointwise and its .binary with the residual added inside), or from plain_from rows MKL
// on the plain matrix (F.linear, addmm).
at::Tensor packed_linear(const at::Tensor& x, const Proj& p, const c10::optional<at::Tensor>& residual) {
  const int64_t plain_from = p.arg[0];
  if (plain_from >= 0 && x.size(0) >= plain_from)
    return residual ? at::addmm(*residual, x, p.w[1].t()) : at::linear(x, p.w[1]);
  if (residual) {
    static auto binary = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const c10::optional<at::Tensor>&, c10::string_view)>();
    return binary.call(x, *residual, p.w[0], c10::nullopt, "add");
  }
  static auto pointwise =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            c10::string_view, c10::List<c10::optional<at::Scalar>>,
                            c10::optional<c10::string_view>)>();
  return pointwise.call(x, p.w[0], c10::nullopt, "none", c10::List<c10::optional<at::Scalar>>(),
                        c10::string_view(""));
}

// x @ W.T (+ residual) on the kernel the projection's module takes for x's rows.
at::Tensor project(const at::Tensor& x, const Proj& p, const c10::optional<at::Tensor>& residual) {
  switch (p.kind) {
    case kInt4Amx:
      if (x.size(0) <= p.arg[1]) return int4_gemm_rows(x, p.w[0], p.w[1], residual, p.arg[0]);
      return int4_gemm(x, p.w[0], p.w[1], residual);
    case kPacked:
      return packed_linear(x, p, residual);
    case kInt4Avx2:
      if (p.arg[1] >= 0 && x.size(0) >= p.arg[1])
        return packed_linear(x, Proj{kPacked, p.w + 2, p.arg + 2}, residual);
      if (p.arg[0] == 8) return int4_gemm_avx2_q8(x, p.w[0], p.w[1], residual);
      return int4_gemm_avx2(x, p.w[0], p.w[1], residual);
    case kInt4Avx512:
      if (p.arg[0] >= 0 && x.size(0) >= p.arg[0])
        return packed_linear(x, Proj{kPacked, p.w + 2, p.arg + 1}, residual);
      return int4_gemm_avx512(x.contiguous(), p.w[0], p.w[1], residual);
    default:
      TORCH_CHECK(false, "decoder_layers: no projection kind ", p.kind);
  }
}

// silu(gate) * up of x's gate_up projection: on the tiles in one pass (int4_gemm_silu, the same bits as
// the two ops), else the projection then silu_and_mul.
at::Tensor mlp_act(const at::Tensor& x, const Proj& p) {
  if (p.kind == kInt4Amx && x.size(0) > p.arg[1]) return int4_gemm_silu(x, p.w[0], p.w[1]);
  return conveyor::silu_and_mul(project(x, p, c10::nullopt));
}

// The step's attention plan (kernels/torch_plan.py Native) and the kernel's settings.
struct Plan {
  const at::Tensor &slot_mapping, &block_tables, &q_start, &q_len, &seq_len;
  double scale;
  int64_t part_tokens;
  c10::string_view isa;
};

// One layer: DecoderLayer.forward's native path, op for op. h [T, E] -> [T, E].
at::Tensor layer(const at::Tensor& h, const Layer& w, const at::Tensor& kv, const at::Tensor& table,
                 const at::Tensor& positions, const Plan& p, int64_t H, int64_t Hkv, double eps) {
  const int64_t T = h.size(0), D = kv.size(-1);
  at::Tensor x = conveyor::rms_norm(h, *w.input_norm, eps);  // [T, E]
  at::Tensor qkv = project(x, w.qkv, c10::nullopt);          // [T, (H + 2Hkv) * D]
  at::Tensor qk = qkv.narrow(1, 0, (H + Hkv) * D).view({T, H + Hkv, D});
  conveyor::rope_(qk, table, positions);
  at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  at::Tensor o = conveyor::write_and_attend(qk.narrow(1, 0, H), qk.narrow(1, H, Hkv), v, kv.select(0, 0),
                                            kv.select(0, 1), p.slot_mapping, p.block_tables, p.q_start, p.q_len,
                                            p.seq_len, p.scale, p.part_tokens, 0, 0.0, p.isa);  // [T, H, D]
  at::Tensor h2 = project(o.view({T, H * D}), w.o, h);  // h + o_proj(o)
  x = conveyor::rms_norm(h2, *w.post_norm, eps);
  return project(mlp_act(x, w.gate_up), w.down, h2);  // h2 + down_proj(silu(gate) * up)
}

// h [T, E] (bfloat16 or float32, the cache's dtype) through every layer -> [T, E]; kv_cache [layers, 2,
// blocks, block_size, Hkv, D]; weights and projections: Reader's order, Kind's contents; table [P, D/2, 2]
// float32 and positions [T] int64 (rope_'s); the rest is the step's plan for write_and_attend
// (TorchBackend.native_step).
at::Tensor decoder_layers(const at::Tensor& h, at::TensorList weights, at::IntArrayRef projections,
                          const at::Tensor& kv_cache, const at::Tensor& table, const at::Tensor& positions,
                          int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& q_start,
                          const at::Tensor& q_len, const at::Tensor& seq_len, int64_t part_tokens, c10::string_view isa) {
  const int64_t layers = kv_cache.size(0);
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2, "decoder_layers: kv_cache [layers, 2, ...]");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == kv_cache.scalar_type() &&
                  (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kFloat),
              "decoder_layers: h [T, E] and the cache in one dtype, bfloat16 or float32");
  // every layer read before the first runs: a malformed list fails before the cache is written
  Reader read{weights, projections};
  std::vector<Layer> stack;
  stack.reserve(layers);
  for (int64_t l = 0; l < layers; ++l) stack.push_back(read.layer());
  TORCH_CHECK(read.wi == weights.size() && read.ii == projections.size(), "decoder_layers: ", layers,
              " layers' weights and ", layers * kProjections, " projections, nothing more");
  const Plan plan{slot_mapping, block_tables, q_start, q_len, seq_len, scale, part_tokens, isa};
  at::Tensor out = h;
  for (int64_t l = 0; l < layers; ++l)
    out = layer(out, stack[l], kv_cache.select(0, l), table, positions, plan, num_heads, num_kv_heads, eps);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("decoder_layers(Tensor h, Tensor[] weights, int[] projections, Tensor(a!) kv_cache, Tensor table, "
        "Tensor positions, int num_heads, int num_kv_heads, float eps, float scale, "
        "Tensor slot_mapping, Tensor block_tables, Tensor q_start, Tensor q_len, Tensor seq_len, int part_tokens, "
        "str isa='auto') -> Tensor");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &decoder_layers);
  // oneDNN's packed matrices (kPacked) are MkldnnCPU tensors, so a list holding them dispatches there
  m.impl("decoder_layers", c10::DispatchKey::MkldnnCPU, &decoder_layers);
}
