// What the two AVX2 int4 GEMMs share (quant_gemm_avx2.cpp: float32 activations; quant_gemm_avx2_q8.cpp:
// activations rounded to 8 bits): the CPU check, the packed layout's shape (engine/load/int4_avx2.py), and a
// call's checks and dispatch on the scales' type, so both take exactly the same tensors.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace avx2_int4 {

constexpr int kCols = 8;    // output columns of a tile: one ymm of float32
constexpr int kGroup = 32;  // k of a scale group
constexpr int kChunk = 8;   // k of one 32-bit word of codes

// Checked at run time from CPUID: the library is built with -march=native, but the AVX2 code is compiled
// for AVX2 alone (each file's pragma) and said usable only where the CPU has it.
inline bool usable() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// y = x @ W.T (+ residual) through run(x, ldx, M, K, N / 8, codes, scales, y, residual, ldr), after the checks
// below; scales as float32 or as float16 bits (uint16_t), as scale_low holds them, so run is a generic lambda
// over the kernel's run<S>. x float32 [M, K] rows; codes int32 [N/8, K/8, 8]; scale_low float32 or float16
// [N/8, K/32, 2, 8]; residual float32 [M, N] rows.
template <typename Run>
at::Tensor multiply(const char* name, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_low,
                    const c10::optional<at::Tensor>& residual, Run run) {
  TORCH_CHECK(usable(), name, " needs AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: float32 [M, K], rows contiguous");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kInt && codes.size(2) == kCols && codes.is_contiguous(),
              "codes: int32 [N/8, K/8, 8]");
  const int64_t nt = codes.size(0), k = codes.size(1) * kChunk, m = x.size(0), n = nt * kCols;
  TORCH_CHECK(x.size(1) == k && k % kGroup == 0, "x's K must be the codes' (a multiple of 32)");
  TORCH_CHECK(scale_low.is_contiguous() && scale_low.dim() == 4 && scale_low.size(0) == nt &&
                  scale_low.size(1) == k / kGroup && scale_low.size(2) == 2 && scale_low.size(3) == kCols &&
                  (scale_low.scalar_type() == at::kFloat || scale_low.scalar_type() == at::kHalf),
              "scale_low: float32 or float16 [N/8, K/32, 2, 8]");
  const float* res = nullptr;
  int64_t ldr = 0;
  if (residual.has_value()) {
    const at::Tensor& h = *residual;
    TORCH_CHECK(h.dim() == 2 && h.size(0) == m && h.size(1) == n && h.scalar_type() == at::kFloat &&
                    h.stride(1) == 1,
                "residual: float32 [M, N], rows contiguous");
    res = h.data_ptr<float>();
    ldr = h.stride(0);
  }
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0) return y;
  const uint32_t* cp = reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>());
  if (scale_low.scalar_type() == at::kHalf)
    run(x.data_ptr<float>(), x.stride(0), m, k, nt, cp,
        reinterpret_cast<const uint16_t*>(scale_low.data_ptr<at::Half>()), y.data_ptr<float>(), res, ldr);
  else
    run(x.data_ptr<float>(), x.stride(0), m, k, nt, cp, scale_low.data_ptr<float>(), y.data_ptr<float>(), res, ldr);
  return y;
}

}  // namespace avx2_int4
