// Weight-only int4 GEMM with float32 activations for AVX2 + FMA CPUs (the AVX2 EPYC kind, and any x86
// CPU with AVX2): y = x @ W.T (+ residual) with x float32 [M, K], W as engine/load/int4_avx2.py packs
// the Q4_1 codes (w = q * scale + low per group of 32 along k, q in 0..15), y float32 [M, N].
//
// Why: with float32 activations torch's int4 kernel takes a slow path, so our default there served the
// quantized file dequantized to float32 and a one-row step read 8 bytes of weights where the file holds
// 4 bits (issue #25). Here a weight costs 4 bits of memory traffic and two instructions per 8 columns:
// - layout: a tile is 8 output columns (one ymm of outputs); per k chunk of 8 it holds 8 words, word j
//   column j's 8 codes, nibble i = code of k 8c + i. Each tile's words run along k, and each group of 32
//   has its 8 scales and 8 lows (float32, or float16 where they are exact in it: Q4_0 / Q4_1 files).
// - dequantize in registers: nibble i of the 8 words is (words & 0xF << 4i) converted to float, which
//   is q * 2^4i exactly (the top nibble: words >> 28, q itself); x's k = 8c + i is multiplied by 2^-4i
//   beforehand (by 1 for i = 7, exact barring subnormals), so each product is x * q, exact in float32
//   arithmetic as ever: the same value a dequantized panel gives.
// - per output, per group t: g = FMA chain from zero over the group's 32 k in order (x * q), then
//   acc = fma(g, scale, acc) and acc = fma(xsum[t], low, acc), xsum the sum of the row's 32 x in k
//   order; the residual is added last. A row's bits so depend on its x and the weights only: not on M,
//   on the row's place in a block, on the block shape, or on the thread count (threads take whole
//   panels of output columns, never a share of k): issue #30's contract, on this CPU kind.
// - the first block of rows multiplies the codes straight from registers (a decode step reads 4 bits a
//   weight and nothing else); where more rows follow, it also stores the converted panel (q * 2^4i as
//   float32), which the later blocks read from cache with the same products.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include "quant_avx2.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {

using avx2_int4::kChunk;
using avx2_int4::kCols;
using avx2_int4::kGroup;
constexpr int kChunks = kGroup / kChunk;
constexpr int64_t kGroupWords = kChunks * kCols;  // 32 words (128 bytes) of codes per tile per group
constexpr int kMaxC = 2, kMaxR = 6;

// Modes of a block: codes from memory; codes from memory, converted panel stored; converted panel read.
enum Mode { kFresh = 0, kKeep = 1, kKept = 2 };

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Nibble i of 8 words as float: q * 2^4i (i < 7), q (i = 7). Exact: 4 significant bits.
template <int I>
inline __m256 nibble(__m256i w) {
  if constexpr (I == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 28));
  else return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xF << (4 * I))));
}

template <typename S>
struct Panel {
  const uint32_t* codes;  // tile j's words at codes + j * tile_words
  const S* sl;            // tile j's scales and lows at sl + j * tile_sl: per group 8 scales, 8 lows
  int64_t tile_words, tile_sl;
  float* kept;            // the converted panel: k-major, C tiles of 8 per k (kKeep writes, kKept reads)
  const char* next;       // the thread's next panel's codes and scales (prefetched), or null
  const char* next_sl;
};

// One k of the group chain: f (C tiles' converted codes at that k) times each row's scaled x.
template <int R, int C, int M, int I, typename S>
inline void step(__m256 (&g)[R][C], const __m256i (&w)[C], const float* xs, int64_t ldx, int64_t k,
                 const Panel<S>& panel) {
  __m256 f[C];
  for (int j = 0; j < C; ++j) {
    if constexpr (M == kKept) f[j] = _mm256_load_ps(panel.kept + (k * C + j) * kCols);
    else f[j] = nibble<I>(w[j]);
    if constexpr (M == kKeep) _mm256_store_ps(panel.kept + (k * C + j) * kCols, f[j]);
  }
  for (int r = 0; r < R; ++r) {
    const __m256 xr = _mm256_broadcast_ss(xs + r * ldx + k);
    for (int j = 0; j < C; ++j) g[r][j] = _mm256_fmadd_ps(xr, f[j], g[r][j]);
  }
}

template <int R, int C, int M, typename S, int... I>
inline void chunk(__m256 (&g)[R][C], const float* xs, int64_t ldx, int64_t k0, int64_t word,
                  const Panel<S>& panel, std::integer_sequence<int, I...>) {
  __m256i w[C];
  // The next panel's codes, a chunk's worth (C / 2 lines) a chunk: a panel is C short streams (a tile
  // is K / 2 bytes) that the hardware prefetcher meets too late.
  if constexpr (M != kKept)
    if (panel.next)
      for (int j = 0; j < C; j += 2) _mm_prefetch(panel.next + (word * C + j * kCols) * 4, _MM_HINT_T0);
  if constexpr (M != kKept)
    for (int j = 0; j < C; ++j)
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel.codes + j * panel.tile_words + word));
  (step<R, C, M, I>(g, w, xs, ldx, k0 + I, panel), ...);
}

// R rows times a panel of C tiles over kt groups -> y[:R, :8 C] (+ the residual's rows).
template <int R, int C, int M, typename S>
void block(const float* xs, int64_t ldx, const float* xsum, int64_t kt, const Panel<S>& panel, float* y,
           int64_t ldy, const float* res, int64_t ldr) {
  alignas(32) float acc[R][C][kCols] = {};
  for (int64_t t = 0; t < kt; ++t) {
    __m256 g[R][C];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) g[r][j] = _mm256_setzero_ps();
    for (int c = 0; c < kChunks; ++c)
      chunk<R, C, M>(g, xs, ldx, t * kGroup + c * kChunk, t * kGroupWords + c * kCols, panel,
                     std::make_integer_sequence<int, kChunk>{});
    if constexpr (M != kKept)
      if (panel.next_sl)
        for (int64_t b = 0; b < C * 2 * kCols * int64_t(sizeof(S)); b += 64)
          _mm_prefetch(panel.next_sl + t * C * 2 * kCols * sizeof(S) + b, _MM_HINT_T0);
    for (int j = 0; j < C; ++j) {
      const S* sl = panel.sl + j * panel.tile_sl + t * 2 * kCols;
      const __m256 scale = load8(sl), low = load8(sl + kCols);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_fmadd_ps(g[r][j], scale, _mm256_load_ps(acc[r][j]));
        _mm256_store_ps(acc[r][j], _mm256_fmadd_ps(_mm256_set1_ps(xsum[r * kt + t]), low, a));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) {
      __m256 v = _mm256_load_ps(acc[r][j]);
      if (res) v = _mm256_add_ps(v, _mm256_loadu_ps(res + r * ldr + kCols * j));
      _mm256_storeu_ps(y + r * ldy + kCols * j, v);
    }
}

template <typename S>
using Block = void (*)(const float*, int64_t, const float*, int64_t, const Panel<S>&, float*, int64_t,
                       const float*, int64_t);

template <typename S, int C, int M, int... R>
constexpr std::array<Block<S>, kMaxR> rows_table(std::integer_sequence<int, R...>) {
  return {block<R + 1, C, M, S>...};
}

template <typename S, int M, int... C>
constexpr std::array<std::array<Block<S>, kMaxR>, kMaxC> cols_table(std::integer_sequence<int, C...>) {
  return {rows_table<S, C + 1, M>(std::make_integer_sequence<int, kMaxR>{})...};
}

// kBlocks<S>[mode][C - 1][R - 1]
template <typename S>
const std::array<std::array<std::array<Block<S>, kMaxR>, kMaxC>, 3> kBlocks = {
    cols_table<S, kFresh>(std::make_integer_sequence<int, kMaxC>{}),
    cols_table<S, kKeep>(std::make_integer_sequence<int, kMaxC>{}),
    cols_table<S, kKept>(std::make_integer_sequence<int, kMaxC>{})};

// xs: x with k = 8c + i scaled by 2^-4i (1 for i = 7); xsum[r][t]: the sum of x[r]'s group t in k order.
void scaled_rows(const float* x, int64_t ldx, int64_t m, int64_t k, float* xs, float* xsum) {
  float scale[kChunk];
  for (int i = 0; i < kChunk; ++i) scale[i] = i == 7 ? 1.f : std::ldexp(1.f, -4 * i);
  const int64_t kt = k / kGroup;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t t = 0; t < kt; ++t) {
      float s = 0.f;
      for (int e = 0; e < kGroup; ++e) {
        const float v = x[r * ldx + t * kGroup + e];
        s += v;
        xs[r * k + t * kGroup + e] = v * scale[e % kChunk];
      }
      xsum[r * kt + t] = s;
    }
}

template <typename S>
void run(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t nt, const uint32_t* codes, const S* sl,
         float* y, const float* res, int64_t ldr) {
  const int64_t kt = k / kGroup, n = nt * kCols;
  std::vector<float> xs(m * k), xsum(m * kt);
  scaled_rows(x, ldx, m, k, xs.data(), xsum.data());
  // Panels of 2 tiles; 1-2 rows a block, more: blocks of 6 rows (12 chains, 2 weights and a broadcast:
  // the 16 ymm registers). Every shape gives the same sums. At 1-2 rows 2 tiles beat 1, 3 and 4 on Zen 1
  // (fewer streams a panel; each group's chains start from zero, so the next group's overlap the last
  // out of order and 2 chains hide the FMA latency): one row is bound by the and, convert and FMA per
  // 8 weights, not by memory (docs/kernels.md).
  const int cols = 2, rows = m <= 2 ? static_cast<int>(m) : kMaxR;
  const int64_t panels = (nt + cols - 1) / cols, tile_words = (k / kChunk) * kCols, tile_sl = kt * 2 * kCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    float* kept = m > rows ? static_cast<float*>(aligned_alloc(32, k * cols * kCols * sizeof(float))) : nullptr;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t tile0 = p * cols;
      const int c = static_cast<int>(std::min<int64_t>(cols, nt - tile0));
      const bool more = p + 1 < p1;
      const Panel<S> panel{codes + tile0 * tile_words, sl + tile0 * tile_sl, tile_words, tile_sl, kept,
                           more ? reinterpret_cast<const char*>(codes + (tile0 + cols) * tile_words) : nullptr,
                           more ? reinterpret_cast<const char*>(sl + (tile0 + cols) * tile_sl) : nullptr};
      for (int64_t r0 = 0; r0 < m; r0 += rows) {
        const int r = static_cast<int>(std::min<int64_t>(rows, m - r0));
        const int mode = r0 ? kKept : (kept ? kKeep : kFresh);
        kBlocks<S>[mode][c - 1][r - 1](xs.data() + r0 * k, k, xsum.data() + r0 * kt, kt, panel,
                                       y + r0 * n + tile0 * kCols, n, res ? res + r0 * ldr + tile0 * kCols : nullptr,
                                       ldr);
      }
    }
    free(kept);
  });
}

}  // namespace

// x [M, K] float32 @ W.T (+ residual [M, N] float32) -> [M, N] float32; W as int4_avx2.pack holds it:
// codes int32 [N/8, K/8, 8], scale_low float32 or float16 [N/8, K/32, 2, 8].
at::Tensor int4_gemm_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_low,
                          const c10::optional<at::Tensor>& residual) {
  return avx2_int4::multiply("int4_gemm_avx2", x, codes, scale_low, residual, [](auto... a) { run(a...); });
}

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("avx2_fma_usable() -> bool", [] { return avx2_int4::usable(); });
  m.def("int4_gemm_avx2(Tensor x, Tensor codes, Tensor scale_low, Tensor? residual=None) -> Tensor");
  m.impl("int4_gemm_avx2", c10::DispatchKey::CPU, &int4_gemm_avx2);
}
