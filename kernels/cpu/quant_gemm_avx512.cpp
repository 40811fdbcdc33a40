// Weight-only int4 GEMM for CPUs with AVX-512 BF16 and no AMX (the AMD EPYC kind): y = x @ W.T with x
// bfloat16 [M, K] and W as the AMX kernel's repacked codes (engine/load/amx.py, quant_int4.h).
//
// Why: without AMX the quantized default switched kernels by row count (torch's int4 kernel for few rows,
// oneDNN's packed bfloat16 copy from a threshold), so a row's bits depended on the step's rows (issue #30),
// and torch's int4 kernel stays near 300 GFLOP/s at any row count (issue #25). Here one arithmetic serves
// every row count:
// - each thread takes whole panels of 32 output columns (never a share of k), dequantizes each weight
//   once per call with quant_int4.h's Int4Tile (the AMX kernel's bfloat16 weights, bit for bit), and
//   multiplies blocks of up to kBlock rows by it with VDPBF16PS;
// - a row's sums are one chain per output, from zero, over the k pairs in order (a tile row of the AMX
//   layout is a k pair of 16 columns: exactly VDPBF16PS's operand), so they depend on that row's x and
//   the weights only: not on M, on the row's place in its block, or on the thread count;
// - the first row block multiplies the weights straight from registers (a decode step of a few rows
//   reads 4 bits a weight and nothing else); where more rows follow, it also keeps the dequantized
//   panel, which the other blocks read from cache (compute speed from ~32 rows).
// VDPBF16PS reads denormals as zero, flushes its outputs and rounds to nearest even whatever MXCSR says,
// so the bits do not depend on the thread's floating-point state either. They differ from the AMX
// kernel's (TDPBF16PS sums even and odd k apart): a row is invariant on one CPU kind, not across kinds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_int4.h"

namespace {

// Checked at run time from CPUID (the library is built for the build machine, but says so honestly).
bool avx512_bf16_usable() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("fma");
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace {

// Rows a block multiplies at once: 12 rows x 2 column tiles = 24 registers of a group's sums, + 2 of
// weights and 1 of x; the totals live in memory (updated once per group).
constexpr int kBlock = 12;
constexpr int64_t kTileBytes = kTileRows * 16, kSzSize = 2 * kTileN;

// Two tile rows of codes (32 bytes: tile rows p and p + 1) -> their 2 x 32 elements as bfloat16 128 + q,
// exact (bits 0x4300 | q): one widening load, a shift and two bit selects for 64 weights, where a float
// dequantization (q * scale + low, rounded) takes about four times the instructions. Tile row p is
// [low nibbles of its 16 bytes, high nibbles], in element order.
inline void biased_rows(const uint8_t* codes, __m512i* row0, __m512i* row1) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  const __m512i bias = _mm512_set1_epi16(0x4300), nibble = _mm512_set1_epi16(0x000F);
  const __m512i lo = _mm512_ternarylogic_epi32(words, nibble, bias, 0xEA);  // (w & 0xF) | 0x4300
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, bias, 0xEA);
  *row0 = _mm512_shuffle_i64x2(lo, hi, 0x44);  // lo's words 0..15, hi's 0..15
  *row1 = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // lo's words 16..31, hi's 16..31
}

// Where a block reads the panel's codes: from memory (stored to `keep` as biased bfloat16 as well where it
// is not null) or from a panel kept by an earlier block. The scales always come from the codes' stream.
struct Panel {
  const uint8_t* codes;
  const bf* sz;
  bf* keep;
  const bf* kept;
};

// R rows of x (R <= kBlock) times one panel of C (1 or 2) column tiles over kt k tiles (one scale group
// each) -> y[:R, n0 : n0 + 16 C] (+ the residual's rows). Per output, per group t: g = VDPBF16PS chain from
// zero over the group's 16 k pairs in order (x times 128 + q: exact products), then acc = fma(g, scale,
// acc) and acc = fma(xsum[t], shift, acc), since w = (q - 8) scale + zero = (128 + q) scale + shift with
// shift = zero - 136 scale. xb: the block's rows of x as pack_rows lays them out (k pair kp of row r at
// kp R + r: every broadcast is one offset from one pointer). xsum: each row's group sums of x (pack_rows),
// fixed by the row alone.
template <int R, int C>
void block(const int32_t* xb, const float* xsum, int64_t kt, const Panel& panel, bf* y, int64_t ldy,
           const bf* res, int64_t ldr, int64_t n0) {
  alignas(64) float acc[R][C][kTileN] = {};
  for (int64_t t = 0; t < kt; ++t) {
    const uint8_t* tc = panel.codes + t * C * kTileBytes;
    const bf* ts = panel.sz + t * C * kSzSize;
    if (!panel.kept) {
      for (int l = 0; l < 4 * C; ++l) __builtin_prefetch(tc + kPrefetchTiles * kTileBytes + 64 * l);
      __builtin_prefetch(ts + kPrefetchTiles * kTileBytes / 8);
    }
    __m512 g[R][C];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) g[r][j] = _mm512_setzero_ps();
    for (int p = 0; p < kTileRows; p += 2) {  // k pairs p and p + 1 of group t
      __m512i w[2][C];
      for (int j = 0; j < C; ++j) {
        const int64_t at = (t * C + j) * kTileElems + p * kTileK;
        if (panel.kept) {
          w[0][j] = _mm512_load_si512(panel.kept + at);
          w[1][j] = _mm512_load_si512(panel.kept + at + kTileK);
        } else {
          biased_rows(tc + j * kTileBytes + 16 * p, &w[0][j], &w[1][j]);
          if (panel.keep) {
            _mm512_store_si512(panel.keep + at, w[0][j]);
            _mm512_store_si512(panel.keep + at + kTileK, w[1][j]);
          }
        }
      }
      const int32_t* xp = xb + (t * kTileRows + p) * R;
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[h * R + r]);
          for (int j = 0; j < C; ++j) g[r][j] = _mm512_dpbf16_ps(g[r][j], xv, (__m512bh)w[h][j]);
        }
    }
    for (int j = 0; j < C; ++j) {
      const __m512 scale = widen16(ts + j * kSzSize), zero = widen16(ts + j * kSzSize + kTileN);
      const __m512 shift = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), scale, zero);
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(acc[r][j], _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * kt + t]), shift,
                                                   _mm512_fmadd_ps(g[r][j], scale, _mm512_load_ps(acc[r][j]))));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) {
      __m512 v = _mm512_load_ps(acc[r][j]);
      if (res) v = _mm512_add_ps(v, widen16(res + r * ldr + n0 + kTileN * j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + n0 + kTileN * j),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// x's rows [r0, r0 + rows) -> out, k pair kp of row r at kp rows + r (block's layout), and each row's
// group sums xsum[r][t] (the sum of its 32 values of group t, from zero in k order: a row's own, whatever
// M), both for the block's rows at once: a lane per row, the adds in the same order as one row alone.
void pack_rows(const bf* x, int64_t ldx, int64_t rows, int64_t kt, int32_t* out, float* xsum) {
  const int64_t pairs = kt * kTileRows;
  for (int64_t kp = 0; kp < pairs; ++kp)
    for (int64_t r = 0; r < rows; ++r) std::memcpy(out + kp * rows + r, x + r * ldx + 2 * kp, sizeof(int32_t));
  const __mmask16 lanes = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  alignas(64) float sums[kTileN];
  for (int64_t t = 0; t < kt; ++t) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t kp = t * kTileRows; kp < (t + 1) * kTileRows; ++kp) {
      const __m512i pair = _mm512_maskz_loadu_epi32(lanes, out + kp * rows);
      s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));  // k = 2 kp
      s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(pair, high)));  // k = 2 kp + 1
    }
    _mm512_store_ps(sums, s);
    for (int64_t r = 0; r < rows; ++r) xsum[r * kt + t] = sums[r];
  }
}

using Block = void (*)(const int32_t*, const float*, int64_t, const Panel&, bf*, int64_t, const bf*, int64_t, int64_t);
constexpr Block kBlocks[2][kBlock] = {
    {block<1, 1>, block<2, 1>, block<3, 1>, block<4, 1>, block<5, 1>, block<6, 1>, block<7, 1>, block<8, 1>,
     block<9, 1>, block<10, 1>, block<11, 1>, block<12, 1>},
    {block<1, 2>, block<2, 2>, block<3, 2>, block<4, 2>, block<5, 2>, block<6, 2>, block<7, 2>, block<8, 2>,
     block<9, 2>, block<10, 2>, block<11, 2>, block<12, 2>}};

}  // namespace

// x [M, K] bfloat16 @ W.T (+ residual [M, N]) -> [M, N] bfloat16, W as amx.pack_int4's codes and scales.
at::Tensor int4_gemm_avx512(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                            const c10::optional<at::Tensor>& residual) {
  static const bool usable = avx512_bf16_usable();
  TORCH_CHECK(usable, "int4_gemm_avx512 needs AVX-512 BF16");
  const std::pair<int64_t, int64_t> counts = tile_counts(x, codes, scale_zero);
  const int64_t nt = counts.first, kt = counts.second, n = nt * kTileN, m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const std::pair<const bf*, int64_t> residual_at = residual_rows(residual, m, n);
  const bf* res = residual_at.first;  // plain names: a lambda cannot capture a structured binding in C++17
  const int64_t ldr = residual_at.second, ldx = x.stride(0);
  if (m == 0) return y;
  const bf* xp = x.data_ptr<bf>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const bf* sp = scale_zero.data_ptr<bf>();
  bf* yp = y.data_ptr<bf>();
  // x in row blocks (pack_rows), once per call: every panel reads a block as one stream
  const int64_t blocks = (m + kBlock - 1) / kBlock, pairs = kt * kTileRows;
  const std::unique_ptr<int32_t[]> xpacked(new int32_t[m * pairs]);  // every word written below
  std::vector<float> xsum(m * kt);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kBlock;
      pack_rows(xp + r0 * ldx, ldx, std::min<int64_t>(kBlock, m - r0), kt, xpacked.get() + r0 * pairs,
                xsum.data() + r0 * kt);
    }
  });
  const int64_t panels = (nt + 1) / 2, codes_step = kt * kTileBytes, sz_step = kt * kSzSize;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    // this thread's unpacked panel, kept where more than one block of rows reads it
    bf* kept = m > kBlock ? static_cast<bf*>(aligned_alloc(64, kt * 2 * kTileElems * sizeof(bf))) : nullptr;
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = (2 * p + 1 < nt) ? 2 : 1;
      const Panel fresh{cp + 2 * p * codes_step, sp + 2 * p * sz_step, kept, nullptr};
      const Panel cached{fresh.codes, fresh.sz, nullptr, kept};
      for (int64_t r0 = 0; r0 < m; r0 += kBlock) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlock, m - r0));
        kBlocks[cols - 1][rows - 1](xpacked.get() + r0 * pairs, xsum.data() + r0 * kt, kt, r0 ? cached : fresh,
                                    yp + r0 * n, n, res ? res + r0 * ldr : nullptr, ldr, kPanelN * p);
      }
    }
    free(kept);
  });
  return y;
}

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("avx512_bf16_usable() -> bool", [] { return avx512_bf16_usable(); });
  m.def("int4_gemm_avx512(Tensor x, Tensor codes, Tensor scale_zero, Tensor? residual=None) -> Tensor");
  m.impl("int4_gemm_avx512", c10::DispatchKey::CPU, &int4_gemm_avx512);
}
