// The int4 GEMM of quant_gemm_avx2.cpp with 8-bit activations, as llama.cpp multiplies a Q4_1 file on AVX2
// (its Q4_1 x Q8_1 dot product): y = x @ W.T (+ residual), the same packed codes and scales, x float32.
//
// Why: with float32 activations each weight costs an and, a convert and an FMA (8 weights to a register), and
// one decode row is bound by those micro-ops, not by memory (docs/kernels.md). With x in 8 bits a weight costs
// a quarter of a `vpmaddubsw` (32 products of an unsigned code and a signed activation, summed in pairs into
// 16-bit lanes): integer sums, exact, a float32 multiply per group of 32.
// - x: per row and group of 32 k, d = max |x| / 127 and xq = round-to-nearest-even(x * (127 / max |x|)), in
//   -127..127 (all zero where the group is). Its bytes are stored per chunk of 8 k as k 0 2 4 6 1 3 5 7, so
//   that one 32-bit broadcast meets the low nibbles of a chunk's word (k 8c + 2b in byte b) and the next
//   one the high nibbles (k 8c + 2b + 1).
// - per output and group t: s = the exact integer sum of q * xq over the group's 32 k (16-bit lanes hold at
//   most 16 products of 15 * 127 = 30,480 before one `vpmaddwd` widens them), then acc = fma(float(s), scale
//   * d, acc) and acc = fma(xsum, low, acc), xsum the row's float32 sum of its group's x in one fixed order
//   (eight lanes of k = j mod 8, then a fixed tree); the residual is added last. A row's bits so depend on
//   its x and the weights only: not on M, the block shape or the thread count (threads take whole tiles of 8
//   output columns, never k).
// Its results differ from the float kernel's by x's rounding to 8 bits (a relative error near 2^-8 a
// group); engine/load/int4_avx2.py says where the engine takes it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops.h"
#include "quant_avx2.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {

using avx2_int4::kChunk;
using avx2_int4::kCols;
using avx2_int4::kGroup;
constexpr int kChunks = kGroup / kChunk;
constexpr int64_t kGroupWords = kChunks * kCols;  // 32 words of codes per tile per group
// rows a block: 5 rows' 16-bit sums and float32 sums, the tile's codes, the mask and a broadcast fill the 16
// ymm registers (6 rows spill)
constexpr int kMaxR = 5;
// bytes of 8-bit x a panel of rows holds: a quarter of Zen 1's L2 (64 KiB and 256 KiB measured the same)
constexpr int64_t kPanelBytes = 128 * 1024;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float sum8(__m256 v) {  // lanes j + 4, then j + 2, then j + 1: one fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Row r of x -> xq (k bytes, each chunk's in the order 0 2 4 6 1 3 5 7), d and xsum per group. Vectorized (4.6x
// the scalar loop's speed: it was about a twentieth of a call's time); `vcvtps2dq` rounds to nearest even, as
// nearbyint does, and the packs saturate nothing (|x * 127 / max| <= 127).
void quantize_row(const float* x, int64_t k, int8_t* xq, float* d, float* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  // after the packs, dwords hold k 0-3 of chunks 0..3, then k 4-7 of each: back to k order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i chunk_order = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                               0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t t = 0; t < k / kGroup; ++t) {
    const float* g = x + t * kGroup;
    const __m256 v0 = _mm256_loadu_ps(g), v1 = _mm256_loadu_ps(g + 8), v2 = _mm256_loadu_ps(g + 16),
                 v3 = _mm256_loadu_ps(g + 24);
    const float amax = max8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                          _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3))));
    xsum[t] = sum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    d[t] = amax / 127.f;
    const __m256 s = _mm256_set1_ps(inv);
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, s)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, s)),
                  q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, s)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, s));
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + t * kGroup),
                        _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(b, order), chunk_order));
  }
}

struct Rows {
  const int8_t* xq;  // row r's bytes at xq + r * k
  const float *d, *xsum;  // row r's groups at + r * kt
  int64_t k, kt;
};

// R rows times one tile (8 output columns: its codes and its scales and lows) over every group -> y[:R, :8]
// (+ the residual's rows). One tile a thread's unit of work: at one row it ran 1.2-1.3x faster than panels
// of 2 or 4 tiles, with or without prefetching the next panel (docs/kernels.md).
template <int R, typename S>
void block(const Rows& x, const uint32_t* codes, const S* sl, float* y, int64_t ldy, const float* res,
           int64_t ldr) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t t = 0; t < x.kt; ++t) {
    __m256i s16[R];
    for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
    for (int c = 0; c < kChunks; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + t * kGroupWords + c * kCols));
      const __m256i lo = _mm256_and_si256(w, mask), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(x.xq + r * x.k + t * kGroup + c * kChunk);
        const __m256i xlo = _mm256_set1_epi32(xr[0]), xhi = _mm256_set1_epi32(xr[1]);
        s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, xlo));
        s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, xhi));
        // Pin the sum in its register: left free, GCC reassociates the integer adds into trees over every
        // chunk, holds the products in 20-odd registers and spills them (1.18x slower from 8 rows up)
        asm("" : "+x"(s16[r]));
      }
    }
    const __m256 scale = load8(sl + t * 2 * kCols), low = load8(sl + t * 2 * kCols + kCols);
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones));
      const __m256 a = _mm256_fmadd_ps(s, _mm256_mul_ps(scale, _mm256_set1_ps(x.d[r * x.kt + t])), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.xsum[r * x.kt + t]), low, a);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 v = acc[r];
    if (res) v = _mm256_add_ps(v, _mm256_loadu_ps(res + r * ldr));
    _mm256_storeu_ps(y + r * ldy, v);
  }
}

template <typename S>
using Block = void (*)(const Rows&, const uint32_t*, const S*, float*, int64_t, const float*, int64_t);

// kBlocks<S>[R - 1]
template <typename S, int... R>
constexpr std::array<Block<S>, kMaxR> rows_table(std::integer_sequence<int, R...>) {
  return {block<R + 1, S>...};
}
template <typename S>
constexpr auto kBlocks = rows_table<S>(std::make_integer_sequence<int, kMaxR>{});

template <typename S>
void run(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t nt, const uint32_t* codes, const S* sl,
         float* y, const float* res, int64_t ldr) {
  const int64_t kt = k / kGroup, n = nt * kCols, tile_words = (k / kChunk) * kCols, tile_sl = kt * 2 * kCols;
  std::vector<int8_t> xq(m * k);
  std::vector<float> d(m * kt), xsum(m * kt);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {  // each row alone: any split gives the same bytes
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(x + r * ldx, k, xq.data() + r * k, d.data() + r * kt, xsum.data() + r * kt);
  });
  // A thread sweeps its tiles once per panel of rows whose 8-bit x stays in its L2 (kPanelBytes): over all rows
  // at once, 2,048 prompt rows of x (1.2-3 MB) came from L3 once per tile, 86-87 GFLOP/s against 93-94 (a
  // served burst's steps are 2,048 rows). Rows still go through blocks alone, so no row's bits move.
  const int64_t panel = std::max<int64_t>(kMaxR, kPanelBytes / k / kMaxR * kMaxR);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t p0 = 0; p0 < m; p0 += panel) {
      const int64_t p1 = std::min(m, p0 + panel);
      for (int64_t tile = t0; tile < t1; ++tile)
        for (int64_t r0 = p0; r0 < p1; r0 += kMaxR) {
          const int r = static_cast<int>(std::min<int64_t>(kMaxR, p1 - r0));
          const Rows rows{xq.data() + r0 * k, d.data() + r0 * kt, xsum.data() + r0 * kt, k, kt};
          kBlocks<S>[r - 1](rows, codes + tile * tile_words, sl + tile * tile_sl, y + r0 * n + tile * kCols, n,
                            res ? res + r0 * ldr + tile * kCols : nullptr, ldr);
        }
    }
  });
}

}  // namespace

// x [M, K] float32 @ W.T (+ residual [M, N] float32) -> [M, N] float32, x rounded to 8 bits per group of 32;
// W as int4_gemm_avx2 takes it: codes int32 [N/8, K/8, 8], scale_low float32 or float16 [N/8, K/32, 2, 8].
at::Tensor int4_gemm_avx2_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_low,
                             const c10::optional<at::Tensor>& residual) {
  return avx2_int4::multiply("int4_gemm_avx2_q8", x, codes, scale_low, residual, [](auto... a) { run(a...); });
}

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("int4_gemm_avx2_q8(Tensor x, Tensor codes, Tensor scale_low, Tensor? residual=None) -> Tensor");
  m.impl("int4_gemm_avx2_q8", c10::DispatchKey::CPU, &int4_gemm_avx2_q8);
}
