// The small ops of a decoder layer, each one pass over its rows instead of a chain of ATen ops.
//
// At decode sizes a layer's RMSNorm was ten ATen calls (cast, pow, mean, add, rsqrt, mul, cast, mul, ...)
// and RoPE six (cast, complex views, multiply, cast back): each call costs microseconds of dispatch on a
// vector of a few hundred numbers, which made norms and RoPE a fifth of a one-token step. SiLU(gate) x up
// was two ops and two passes over the gate_up GEMM's output. Each op here computes a row from that row
// alone, in a fixed order (no dependence on the number of rows or threads), and rounds where PyTorch's own
// ops round.
//
// The arithmetic is ATen's own vector type (at::vec::Vectorized, the one torch's CPU kernels use, with
// Sleef's exp), compiled here for the widest vectors this CPU has. Every element, the ragged end of a row
// included, goes through the same vector code (a partial load pads with zeros), so an element's bits do
// not depend on where it sits in a row; SiLU x up then has F.silu's bits wherever torch's kernel also
// vectorizes the element. Work is split over threads only where a task gets kGrainElems elements: a
// parallel region costs more than a decode step's norm.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using BF16 = c10::BFloat16;
constexpr int64_t W = Vec::size();
constexpr int64_t kGrainElems = 32768;  // elements a thread's task must have before a row range is split

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

// Two vectors at a time (2W elements: one bfloat16 vector) widened to float; lanes past n are zero. store2
// writes back n, rounded as torch rounds.
struct Pair {
  Vec a, b;
};
[[gnu::always_inline]] inline Pair load2(const float* p, int64_t n) {
  return {Vec::loadu(p, std::min(n, W)), Vec::loadu(p + W, std::clamp<int64_t>(n - W, 0, W))};
}
[[gnu::always_inline]] inline Pair load2(const BF16* p, int64_t n) {
  auto [a, b] = at::vec::convert_to_float<BF16>(at::vec::Vectorized<BF16>::loadu(p, std::min(n, 2 * W)));
  return {a, b};
}
[[gnu::always_inline]] inline void store2(float* p, const Pair& v, int64_t n) {
  v.a.store(p, std::min(n, W));
  v.b.store(p + W, std::clamp<int64_t>(n - W, 0, W));
}
// Two float vectors rounded to one bfloat16 vector exactly as ATen's convert_from_float rounds them (to
// nearest even; a NaN becomes 0xFFFF). Where the CPU has AVX-512 BF16, VCVTNE2PS2BF16 does it in one
// instruction instead of ATen's sixteen: the same bits for every value but NaNs and denormal inputs (which
// it reads as zero), so a vector holding either takes ATen's path.
[[gnu::always_inline]] inline at::vec::Vectorized<BF16> to_bf16(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // fpclass: quiet NaN, denormal, signalling NaN
  const __m512 va = a, vb = b;
  if (!(_mm512_fpclass_ps_mask(va, kNanOrDenormal) | _mm512_fpclass_ps_mask(vb, kNanOrDenormal)))
    return at::vec::Vectorized<BF16>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(vb, va)));
#endif
  return at::vec::convert_from_float<BF16>(a, b);
}
[[gnu::always_inline]] inline void store2(BF16* p, const Pair& v, int64_t n) {
  to_bf16(v.a, v.b).store(p, std::min(n, 2 * W));
}
// exp for SiLU: Sleef's (1 ulp, F.silu's) in float32; in bfloat16 ATen's 20-ulp polynomial (the one its
// softmax uses, inlined instead of a library call), whose error is a thousandth of the bfloat16 rounding
// that follows (the same bits as F.silu but for rare last-bit ties; tests/kernels/test_fused_layer_ops.py).
Vec silu_exp(const Vec& v, const float*) { return v.exp(); }
Vec silu_exp(const Vec& v, const BF16*) { return v.exp_u20(); }
// v as it reads back after a store in T: what the next op of a PyTorch chain sees.
[[gnu::always_inline]] inline Pair rounded(const Pair& v, const float*) { return v; }
[[gnu::always_inline]] inline Pair rounded(const Pair& v, const BF16*) {
  auto [a, b] = at::vec::convert_to_float<BF16>(to_bf16(v.a, v.b));
  return {a, b};
}

template <typename T>
void rms_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t D = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  constexpr int64_t kRows = 4;  // rows whose sums of squares run side by side: each is one chain of FMAs
  at::parallel_for(0, x.size(0), grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t q = r0; q < r1; q += kRows) {
      const int64_t n = std::min(kRows, r1 - q);
      Vec acc[kRows];  // row k's lane l sums elements l, l + W, ...; the lanes then in order
      for (int64_t k = 0; k < kRows; ++k) acc[k] = Vec(0.f);
      for (int64_t i = 0; i < D; i += 2 * W)
        for (int64_t k = 0; k < n; ++k) {
          const Pair v = load2(xp + (q + k) * xs + i, D - i);
          acc[k] = at::vec::fmadd(v.b, v.b, at::vec::fmadd(v.a, v.a, acc[k]));
        }
      for (int64_t k = 0; k < n; ++k) {
        const T* row = xp + (q + k) * xs;
        __at_align__ float lanes[W];
        acc[k].store(lanes);
        float ss = 0.f;
        for (int64_t l = 0; l < W; ++l) ss += lanes[l];
        const Vec inv(1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps)));
        T* o = op + (q + k) * D;
        // As torch's own kernel: x * inv * weight in float32, rounded once to the input's dtype.
        for (int64_t i = 0; i < D; i += 2 * W) {
          const Pair v = load2(row + i, D - i), g = load2(wp + i, D - i);
          store2(o + i, {v.a * inv * g.a, v.b * inv * g.b}, D - i);
        }
      }
    }
  });
}

#ifdef CPU_CAPABILITY_AVX512
// One row of silu_mul_rows<BF16> with the gates' SiLU looked up in table (silu_table): the same product
// and rounding.
void silu_mul_lookup(const BF16* gate, const BF16* up, BF16* o, int64_t I, const float* table) {
  for (int64_t i = 0; i < I; i += 2 * W) {
    const int64_t n = std::min<int64_t>(I - i, 2 * W);
    const __m512i g = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), gate + i);
    const Vec sa(_mm512_i32gather_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(g)), table, 4));
    const Vec sb(_mm512_i32gather_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(g, 1)), table, 4));
    const Pair u = load2(up + i, I - i);
    store2(o + i, {sa * u.a, sb * u.b}, I - i);
  }
}
#endif

template <typename T>
void silu_mul_rows(const at::Tensor& x, at::Tensor& out, bool lookup) {
  const int64_t I = out.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const Vec one(1.f);
#ifdef CPU_CAPABILITY_AVX512
  if constexpr (std::is_same_v<T, BF16>)
    if (lookup) {
      const float* table = conveyor::silu_table();
      at::parallel_for(0, x.size(0), grain_rows(I), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) silu_mul_lookup(xp + r * xs, xp + r * xs + I, op + r * I, I, table);
      });
      return;
    }
#endif
  at::parallel_for(0, x.size(0), grain_rows(I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T *gate = xp + r * xs, *up = gate + I;
      T* o = op + r * I;
      for (int64_t i = 0; i < I; i += 2 * W) {
        const Pair g = load2(gate + i, I - i), u = load2(up + i, I - i);
        // F.silu's vector formula, rounded to T as its output is, then mul_(up)
        const Pair s = rounded({g.a / (one + silu_exp(g.a.neg(), o)), g.b / (one + silu_exp(g.b.neg(), o))}, o);
        store2(o + i, {s.a * u.a, s.b * u.b}, I - i);
      }
    }
  });
}

template <typename T>
void rope_rows(at::Tensor& x, const at::Tensor& table, const at::Tensor& positions) {
  const int64_t N = x.size(1), D = x.size(2), st = x.stride(0), sn = x.stride(1);
  const int64_t tstride = table.stride(0);
  T* xp = x.data_ptr<T>();
  const float* tp = table.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), grain_rows(N * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cs = tp + pos[t] * tstride;  // [D/2, 2]: cos, sin
      for (int64_t h = 0; h < N; ++h) {
        T* v = xp + t * st + h * sn;
        for (int64_t j = 0; j < D; j += 2 * W) {  // W pairs at a time: evens a, odds b
          const Pair x2 = load2(v + j, D - j), cs2 = load2(cs + j, D - j);
          auto [a, b] = at::vec::deinterleave2(x2.a, x2.b);
          auto [c, s] = at::vec::deinterleave2(cs2.a, cs2.b);
          auto [lo, hi] = at::vec::interleave2(a * c - b * s, a * s + b * c);
          store2(v + j, {lo, hi}, D - j);
        }
      }
    }
  });
}

// K or V rows x [T, Hkv, D] into their cache slots: cache [blocks, block_size, Hkv, D] viewed as [S, Hkv, D],
// row t to slot slots[t], as index_copy_ does (a copy: the same bits). Rows whose heads lie contiguously (views
// of the QKV GEMM's output) are copied row by row (at decode sizes index_copy_'s set-up costs more than the
// copy); any other layout goes through index_copy_ itself.
void write_rows(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 3 && cache.dim() == 4 && x.size(1) == cache.size(2) && x.size(2) == cache.size(3),
              "write: x [T, Hkv, D] for a cache [blocks, block_size, Hkv, D]");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type() && cache.is_contiguous(), "write: x in the cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == x.size(0),
              "write: slot_mapping [T] int64");
  if (x.stride(2) != 1 || x.stride(1) != x.size(2) || !slots.is_contiguous()) {
    cache.view({-1, cache.size(2), cache.size(3)}).index_copy_(0, slots, x);
    return;
  }
  const int64_t n_slots = cache.size(0) * cache.size(1), bytes = x.size(1) * x.size(2) * x.element_size();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < n_slots, "write: slot ", s[t], " outside the cache");
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t row_stride = x.stride(0) * x.element_size();
  // a prompt chunk's rows over the threads: each copy's destination is a cold cache line, and one thread
  // waiting on them took ~3% of a 2,048-token step
  at::parallel_for(0, x.size(0), grain_rows(bytes / x.element_size()), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) std::memcpy(dst + s[t] * bytes, src + t * row_stride, bytes);
  });
}

}  // namespace

// The ops, in conveyor:: so other files call them directly (ops.h).
namespace conveyor {

// SiLU of every bfloat16 gate, as the formula below rounds it, widened to float32: a bfloat16 gate has
// 65,536 values, so its exp and division (most of the op's time) run once per process, by the very same
// vector code, and each row looks its gates up (the same bits; tests/kernels/test_fused_layer_ops.py).
const float* silu_table() {
  static const std::vector<float> table = [] {
    std::vector<uint16_t> bits(65536);
    std::vector<float> t(65536);
    for (int i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
    const BF16* g = reinterpret_cast<const BF16*>(bits.data());
    for (int64_t i = 0; i < 65536; i += 2 * W) {
      const Pair v = load2(g + i, 2 * W);
      const Pair s = rounded({v.a / (Vec(1.f) + silu_exp(v.a.neg(), g)), v.b / (Vec(1.f) + silu_exp(v.b.neg(), g))}, g);
      store2(t.data() + i, s, 2 * W);
    }
    return t;
  }();
  return table.data();
}


// x [N, D] (rows may be strided, each row contiguous), weight [D] of x's dtype -> new [N, D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x [N, D] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "rms_norm: weight [D]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight in x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rms_rows<float>(x, weight, out, eps);
  else if (x.scalar_type() == at::kBFloat16)
    rms_rows<BF16>(x, weight, out, eps);
  else
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16, not ", x.scalar_type());
  return out;
}

// x [T, 2I] (gate | up, rows may be strided, each row contiguous) -> new [T, I]: silu(gate) * up, the
// values of F.silu(gate).mul_(up) in one pass over the fused gate_up GEMM's output. lookup: bfloat16 gates'
// SiLU from silu_table where the CPU has AVX-512 (false: the formula per element, for the tests).
at::Tensor silu_and_mul(const at::Tensor& x, bool lookup) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x [T, 2I] with contiguous rows");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_mul_rows<float>(x, out, false);
  else if (x.scalar_type() == at::kBFloat16)
    silu_mul_rows<BF16>(x, out, lookup);
  else
    TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16, not ", x.scalar_type());
  return out;
}

// In place: x [T, N, D] (interleaved pairs, last dim contiguous), table [P, D/2, 2] float32 (cos, sin),
// positions [T] int64: each pair (a, b) of row t turns by the angle of positions[t].
void rope_(at::Tensor x, const at::Tensor& table, const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope_: x [T, N, D], D even, last dim contiguous");
  TORCH_CHECK(table.dim() == 3 && table.size(1) * 2 == x.size(2) && table.size(2) == 2, "rope_: table [P, D/2, 2]");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.stride(2) == 1 && table.stride(1) == 2, "rope_: float32 table");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == x.size(0),
              "rope_: positions [T] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table.size(0), "rope_: position ", pos[t], " outside the table");
  if (x.scalar_type() == at::kFloat)
    rope_rows<float>(x, table, positions);
  else if (x.scalar_type() == at::kBFloat16)
    rope_rows<BF16>(x, table, positions);
  else
    TORCH_CHECK(false, "rope_: float32 or bfloat16, not ", x.scalar_type());
}

// A layer's attention step on the native kernel in one call: K/V written into the cache (write_rows), then
// conveyor_cpu::paged_attention (kernels/cpu/paged_attention.cpp) over every row of q into a new [T, H, D]. The
// same copy and kernel as index_copy_ + paged_attention, without the Python calls between them (views, casts,
// the output's allocation: about six a layer).
at::Tensor write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& seq_len, double scale,
                            int64_t part_tokens, int64_t window, double softcap, c10::string_view isa) {
  using T = const at::Tensor&;
  static const auto attend = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("conveyor_cpu::paged_attention", "")
                                 .typed<void(T, T, T, T, T, T, T, T, double, int64_t, int64_t, double, c10::string_view)>();
  write_rows(k, k_cache, slot_mapping);
  write_rows(v, v_cache, slot_mapping);
  at::Tensor out = at::empty(q.sizes(), q.options());
  attend.call(out, q, k_cache, v_cache, block_tables, q_start, q_len, seq_len, scale, part_tokens, window, softcap,
              isa);
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &conveyor::rms_norm);
  m.def("silu_and_mul(Tensor x, bool lookup=True) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &conveyor::silu_and_mul);
  m.def("rope_(Tensor(a!) x, Tensor table, Tensor positions) -> ()");
  m.impl("rope_", c10::DispatchKey::CPU, &conveyor::rope_);
  m.def("write_and_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor q_start, Tensor q_len, Tensor seq_len, float scale, int part_tokens, int window, "
        "float softcap, str isa='auto') -> Tensor");
  m.impl("write_and_attend", c10::DispatchKey::CPU, &conveyor::write_and_attend);
}
