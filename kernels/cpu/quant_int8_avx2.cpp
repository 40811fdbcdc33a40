// Weight-only int8 GEMM with float32 activations on AVX2 + FMA (Int8Linear: one scale per output row; the tied
// LM head): y[r, n] = (sum_k x[r, k] * q[n, k]) * scale[n]. torch's _weight_int8pack_mm runs a scalar loop
// for float32 activations, so without this a float32 model multiplies a float32 copy of the matrix instead:
// 4 bytes a weight read per decode step where the codes take 1.
//
// Codes are repacked at load (engine/load/int8_avx2.py) into blocks of 8 output rows, k-major: block b holds
// [K][8] int8, so one 8-byte load gives the 8 outputs' codes at one k, converted to float32 in a register
// (an int8 is exact in float32) and multiplied into every row of x at once: each code is read from memory
// once per call and converted once per call up to 8 rows, once per 32 rows beyond (many_rows).
//
// One arithmetic at every row count and thread count: each output of each row is one FMA chain from zero
// over k = 0, 1, ..., K - 1 in order, then times its scale (a plain multiply, after the sum). How many rows
// or output blocks a register tile holds only decides which chains run side by side, never a chain's
// order; threads split the output blocks (N), never k. So a row's bits do not depend on the batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kBlock = 8;     // output rows of a block: one register of float32
constexpr int64_t kPanel = 8;     // blocks a thread's unit of work holds (64 outputs)
constexpr int64_t kChunkRows = 32; // rows of x one pass over the codes takes

bool avx2_usable() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {

// 8 weights of one k: codes converted in the register (exact), or a panel already converted.
inline __m256 weights(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline __m256 weights(const float* w) { return _mm256_loadu_ps(w); }

// Rows [0, M) of x times blocks [0, B) (at blocks, each [K][8]) -> y's M x 8B outputs, scaled.
template <int M, int B, typename W>
inline void tile(const float* x, int64_t ldx, const W* blocks, int64_t k, const float* scale, float* y,
                 int64_t ldy) {
  __m256 acc[M][B];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const __m256 w = weights(blocks + (b * k + i) * kBlock);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) acc[r][b] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + i), w, acc[r][b]);
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) {
    const __m256 s = _mm256_loadu_ps(scale + b * kBlock);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(y + r * ldy + b * kBlock, _mm256_mul_ps(acc[r][b], s));
  }
}

// Rows [0, M) against `blocks` consecutive blocks starting at block j0, B at a time (then one at a time).
template <int M, int B>
void blocks_of(const float* x, int64_t ldx, const int8_t* codes, int64_t k, const float* scale, float* y,
               int64_t ldy, int64_t j0, int64_t blocks) {
  int64_t j = j0;
  for (; j + B <= j0 + blocks; j += B)
    tile<M, B>(x, ldx, codes + j * k * kBlock, k, scale + j * kBlock, y + j * kBlock, ldy);
  for (; j < j0 + blocks; ++j)
    tile<M, 1>(x, ldx, codes + j * k * kBlock, k, scale + j * kBlock, y + j * kBlock, ldy);
}

// Blocks converted at a time for calls of more than 8 rows (a panel of 4 x K x 8 float32: 72 KiB at K = 576,
// in L2), and rows a register tile takes against them: 3 rows x 4 blocks, 12 accumulators and 3 broadcasts of
// x a k (6 rows x 2 blocks, as before, took 6: at 32 rows of the 49,152 x 576 head, 57 GFLOP/s against 69-72).
constexpr int64_t kPanelBlocks = 4;
constexpr int64_t kGroupRows = 3;

// Rows [0, rows) against B blocks already converted (panel [B][K][8] float32), kGroupRows at a time.
template <int B>
void rows_of(const float* x, int64_t ldx, const float* panel, int64_t k, const float* scale, float* y,
             int64_t ldy, int64_t rows) {
  using Tile = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t);
  constexpr Tile kTiles[kGroupRows] = {tile<1, B, float>, tile<2, B, float>, tile<3, B, float>};
  for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
    const int64_t g = std::min(rows - r0, kGroupRows);
    kTiles[g - 1](x + r0 * ldx, ldx, panel, k, scale, y + r0 * ldy, ldy);
  }
}

// Calls of more than 8 rows: per chunk of kChunkRows rows and kPanelBlocks blocks, the blocks' codes converted
// once into a float32 panel (same values, so the same chains and bits as above), which every group of rows reads.
void many_rows(const float* x, int64_t ldx, const int8_t* codes, int64_t k, const float* scale, float* y,
               int64_t ldy, int64_t m, int64_t j0, int64_t j1, float* panel) {
  using Rows = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
  constexpr Rows kRows[kPanelBlocks] = {rows_of<1>, rows_of<2>, rows_of<3>, rows_of<4>};
  for (int64_t c0 = 0; c0 < m; c0 += kChunkRows) {
    const int64_t rows = std::min(m - c0, kChunkRows);
    for (int64_t j = j0; j < j1; j += kPanelBlocks) {
      const int64_t blocks = std::min(kPanelBlocks, j1 - j);
      const int8_t* src = codes + j * k * kBlock;
      for (int64_t i = 0; i < blocks * k; ++i) _mm256_storeu_ps(panel + i * kBlock, weights(src + i * kBlock));
      kRows[blocks - 1](x + c0 * ldx, ldx, panel, k, scale + j * kBlock, y + c0 * ldy + j * kBlock, ldy, rows);
    }
  }
}

using Blocks = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, float*, int64_t, int64_t,
                        int64_t);
// By rows (1..8): as many output blocks side by side as keep 8-12 accumulators and the FMA latency hidden.
constexpr Blocks kBlocks[8] = {blocks_of<1, 8>, blocks_of<2, 4>, blocks_of<3, 4>, blocks_of<4, 2>,
                               blocks_of<5, 2>, blocks_of<6, 2>, blocks_of<7, 1>, blocks_of<8, 1>};

}  // namespace

// x [M, K] float32 @ (q * scale[:, None]).T -> [M, N] float32; codes int8 [N/8, K, 8] (int8_avx2.pack).
at::Tensor int8_gemm_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(avx2_usable(), "the int8 AVX2 kernel needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: float32 [M, K] rows");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kChar && codes.dim() == 3 &&
              codes.size(2) == kBlock && codes.size(1) == x.size(1), "codes: int8 [N/8, K, 8] for x's K");
  const int64_t m = x.size(0), k = x.size(1), nb = codes.size(0), n = nb * kBlock;
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == n, "scale: float32 [N]");
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), panels = (nb + kPanel - 1) / kPanel;
  // Up to 8 rows: one pass over the codes, each converted once for all rows. More: a thread's blocks pass
  // over kChunkRows rows of x at a time (which stay in L2), kPanelBlocks blocks converted at a time.
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t j0 = p0 * kPanel, j1 = std::min(nb, p1 * kPanel);
    if (m <= 8) {
      kBlocks[m - 1](xp, ldx, cp, k, sp, yp, n, j0, j1 - j0);
      return;
    }
    std::vector<float> panel(kPanelBlocks * k * kBlock);
    many_rows(xp, ldx, cp, k, sp, yp, n, m, j0, j1, panel.data());
  });
  return y;
}
#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("int8_gemm_avx2(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.impl("int8_gemm_avx2", c10::DispatchKey::CPU, &int8_gemm_avx2);
}
