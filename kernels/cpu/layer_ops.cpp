// The small ops of a decoder layer, each one pass over its rows instead of a chain of ATen ops.
//
// At decode sizes a layer's RMSNorm was ten ATen calls (cast, pow, mean, add, rsqrt, mul, cast, mul, ...)
// and RoPE six (cast, complex views, multiply, cast back): each call costs microseconds of dispatch on a
// vector of a few hundred numbers, which made norms and RoPE a fifth of a one-token step. Each op here
// computes a row from that row alone, in a fixed order (no dependence on the number of rows or threads),
// and rounds where PyTorch's own composite rounds, so results match F.rms_norm and the complex-multiply
// RoPE to within float rounding.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>

namespace {

constexpr int64_t kGrainRows = 16;  // rows per task: a one-token step runs inline, a prompt chunk in parallel

template <typename T>
void rms_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t D = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + r * xs;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += static_cast<float>(row[i]) * static_cast<float>(row[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      T* o = op + r * D;
      // As torch's own kernel: x * inv * weight in float32, rounded once to the input's dtype.
#pragma omp simd
      for (int64_t i = 0; i < D; ++i)
        o[i] = static_cast<T>(static_cast<float>(row[i]) * inv * static_cast<float>(wp[i]));
    }
  });
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
    rms_rows<c10::BFloat16>(x, weight, out, eps);
  else
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16, not ", x.scalar_type());
  return out;
}

template <typename T>
void rope_rows(at::Tensor& x, const at::Tensor& table, const at::Tensor& positions) {
  const int64_t N = x.size(1), half = x.size(2) / 2, st = x.stride(0), sn = x.stride(1);
  const int64_t tstride = table.stride(0);
  T* xp = x.data_ptr<T>();
  const float* tp = table.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cs = tp + pos[t] * tstride;  // [D/2, 2]: cos, sin
      for (int64_t n = 0; n < N; ++n) {
        T* v = xp + t * st + n * sn;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = static_cast<float>(v[2 * j]), b = static_cast<float>(v[2 * j + 1]);
          const float c = cs[2 * j], s = cs[2 * j + 1];
          v[2 * j] = static_cast<T>(a * c - b * s);
          v[2 * j + 1] = static_cast<T>(a * s + b * c);
        }
      }
    }
  });
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
    rope_rows<c10::BFloat16>(x, table, positions);
  else
    TORCH_CHECK(false, "rope_: float32 or bfloat16, not ", x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("rope_(Tensor(a!) x, Tensor table, Tensor positions) -> ()");
  m.impl("rope_", c10::DispatchKey::CPU, &rope_);
}
