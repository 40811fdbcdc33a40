// The native ops one C++ file calls in another directly, as C++ functions: no dispatcher between them
// (decoder_layers.cpp runs a stack of decoder layers out of these).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

// quant_gemm.cpp: x [M, K] bfloat16 @ W.T (+ residual) on AMX tiles (conveyor_cpu::int4_gemm_amx).
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                     const c10::optional<at::Tensor>& residual);
// quant_gemm.cpp: silu(x @ Wg.T) * (x @ Wu.T) for W = [Wg; Wu], the bits of silu_and_mul(int4_gemm(x))
// (conveyor_cpu::int4_gemm_silu_amx).
at::Tensor int4_gemm_silu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero);
// quant_gemm_rows.cpp: the same bits for a few rows on AVX-512 (conveyor_cpu::int4_gemm_rows).
at::Tensor int4_gemm_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                          const c10::optional<at::Tensor>& residual, int64_t w_min_exponent);
// quant_gemm_avx512.cpp: x [M, K] bfloat16 @ W.T (+ residual) on AVX-512 BF16, the AMX kernel's codes
// (conveyor_cpu::int4_gemm_avx512).
at::Tensor int4_gemm_avx512(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                            const c10::optional<at::Tensor>& residual);
// quant_gemm_avx2.cpp: x [M, K] float32 @ W.T (+ residual) on AVX2 (conveyor_cpu::int4_gemm_avx2).
at::Tensor int4_gemm_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_low,
                          const c10::optional<at::Tensor>& residual);
// quant_gemm_avx2_q8.cpp: the same with x rounded to 8 bits per group of 32 (conveyor_cpu::int4_gemm_avx2_q8).
at::Tensor int4_gemm_avx2_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_low,
                             const c10::optional<at::Tensor>& residual);

// layer_ops.cpp: the ops of the same names in conveyor_cpu.
namespace conveyor {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x, bool lookup = true);
// SiLU of every bfloat16 value (indexed by its bits) as silu_and_mul rounds it, widened to float32.
const float* silu_table();
void rope_(at::Tensor x, const at::Tensor& table, const at::Tensor& positions);
at::Tensor write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& seq_len, double scale,
                            int64_t part_tokens, int64_t window, double softcap, c10::string_view isa);
}  // namespace conveyor
