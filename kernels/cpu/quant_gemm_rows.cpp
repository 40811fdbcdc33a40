// Weight-only int4 GEMMs for a few rows on AVX-512, with the bits of the AMX tiles (quant_gemm.cpp).
//
// Few rows (int4_gemm_rows): dequantizing a panel for one row costs more than multiplying it, and the
// tile multiply adds little, so a decode step of a few rows multiplies on AVX-512 instead, and gives the
// same bits as the tiles. TDPBF16PS's arithmetic, established on this machine (a Sapphire Rapids class
// Xeon; bench/tdpbf16ps_probe.cpp, docs/kernels.md) and what the SDM's pseudo-code says: for each C
// element, the instruction keeps two float32 sums from zero, one over the even k of the tile's 32 and
// one over the odd k, each a chain of FMAs in k order, then adds (even + odd) to C; every step rounds
// to nearest even with input denormals read as zero and output denormals flushed (DAZ, FTZ). vdpbf16ps
// (one chain, pairs added in another order) differs from it in about half of all outputs. The rows path
// runs exactly those FMAs on weights dequantized in registers by the same code as the tiles' (Int4Tile),
// without touching MXCSR where exponents show that DAZ and FTZ cannot act, else with them set per tile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "quant_int4.h"
#include "tile_csr.h"

namespace {

// The rows path (int4_gemm_rows) needs AVX-512 with bfloat16 conversions, not the tiles.
bool cpu_runs_rows() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace {

using conveyor::switch_csr;
using conveyor::tile_csr;

// The compiler does not know that MXCSR changes arithmetic and may move it across _mm_setcsr: a value
// pinned on both sides of the switch is computed before it and used only after it.
template <typename V>
inline void pin(V& v) {
  asm volatile("" : "+v"(v));
}

// TDPBF16PS's arithmetic for rows of a few-row x against a panel of `cols` (1 or 2) 16-column tiles of int4
// codes side by side, kt tiles along k each (in tile_counts's order: tile (t, j) at t * cols + j): xs is x's even k [M][K/2], then its odd k [M][K/2], float32. For each
// 32-k tile: per output an FMA chain from zero over the even k and one over the odd k, in k order, then
// acc += even + odd, with DAZ and FTZ. Two ways:
// - plain (the fast one): the weights dequantized in registers and everything under the caller's MXCSR.
//   Exact where no step can produce a value below float32's smallest normal (the caller checks that from
//   exponents, and reads x's denormals as zero): there DAZ and FTZ never act.
// - switched: MXCSR's DAZ and FTZ set around each tile's FMAs, the tile dequantized before (to a buffer)
//   under the caller's MXCSR, as gemm dequantizes. Exact for every input.
// -> c[M][32] float32.
template <int M, bool plain>
void rows_tiles(const float* xs, int64_t kh, int64_t kt, const uint8_t* codes, const bf* sz, int cols,
                unsigned csr, float* c) {
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const float* xe = xs;
  const float* xo = xs + M * kh;
  __m512 acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  alignas(64) bf buffer[plain ? 1 : 2 * kTileRows * kTileK];
  const int64_t tile_bytes = kTileRows * 16, sz_size = 2 * kTileN, ahead = kPrefetchTiles * tile_bytes;
  for (int64_t t = 0; t < kt; ++t) {
    const uint8_t* tc = codes + t * cols * tile_bytes;
    const bf* ts = sz + t * cols * sz_size;
    for (int l = 0; l < 4 * cols; ++l) __builtin_prefetch(tc + ahead + 64 * l);
    __builtin_prefetch(ts + ahead / 8);  // 64 bytes of scales per 256 of codes
    if (!plain) {
      for (int j = 0; j < cols; ++j) dequant_int4(tc + j * tile_bytes, ts + j * sz_size, buffer + j * kTileRows * kTileK);
      switch_csr(tile_csr(csr));
    }
    const Int4Tile t0(tc, ts), t1(cols == 2 ? tc + tile_bytes : tc, cols == 2 ? ts + sz_size : ts);
    __m512 even[M][2], odd[M][2];
    for (int r = 0; r < M; ++r) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < kTileRows; ++p) {  // k pair p of the tile: k = 32 t + 2 p (even), + 1 (odd)
      const int64_t kp = t * kTileRows + p;
      for (int j = 0; j < 2; ++j) {
        if (j == cols) break;
        const __m512i w = plain ? (j ? t1 : t0).row(p)
                                : _mm512_load_si512(buffer + j * kTileRows * kTileK + p * kTileK);
        // dword i: column i's bfloat16 at the even k (low half), at the odd k (high half)
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(w, odd_mask));
        for (int r = 0; r < M; ++r) {
          even[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xe[r * kh + kp]), we, even[r][j]);
          odd[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xo[r * kh + kp]), wo, odd[r][j]);
        }
      }
    }
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < cols; ++j) {
        acc[r][j] = _mm512_add_ps(acc[r][j], _mm512_add_ps(even[r][j], odd[r][j]));
        if (!plain) pin(acc[r][j]);
      }
    if (!plain) switch_csr(csr);
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < cols; ++j) _mm512_storeu_ps(c + r * kPanelN + kTileN * j, acc[r][j]);
}

using RowsTiles = void (*)(const float*, int64_t, int64_t, const uint8_t*, const bf*, int, unsigned, float*);
constexpr int kMaxRows = 8;  // the rows path takes at most this many rows
constexpr RowsTiles kRowsTiles[2][kMaxRows] = {
    {rows_tiles<1, false>, rows_tiles<2, false>, rows_tiles<3, false>, rows_tiles<4, false>, rows_tiles<5, false>,
     rows_tiles<6, false>, rows_tiles<7, false>, rows_tiles<8, false>},
    {rows_tiles<1, true>, rows_tiles<2, true>, rows_tiles<3, true>, rows_tiles<4, true>, rows_tiles<5, true>,
     rows_tiles<6, true>, rows_tiles<7, true>, rows_tiles<8, true>}};

constexpr int kNoExponent = 1 << 20;  // the least exponent of a matrix or row with no non-zero normal value

// floor(log2 |v|) of a normal bfloat16 (bits), kNoExponent for zeros and denormals (which DAZ reads as 0).
inline int exponent_of(uint16_t bits) {
  const int field = (bits >> 7) & 0xFF;
  return field == 0 ? kNoExponent : field - 127;
}

// The least exponent of the matrix's non-zero weights as the tiles see them (bfloat16 after dequant_int4),
// for int4_gemm_rows's check; computed once per matrix at load.
int64_t int4_min_exponent(const at::Tensor& codes, const at::Tensor& scale_zero) {
  TORCH_CHECK(codes.is_contiguous() && scale_zero.is_contiguous() && scale_zero.scalar_type() == at::kBFloat16);
  const int64_t tiles = codes.numel() / (kTileRows * 16);
  TORCH_CHECK(scale_zero.numel() == tiles * 2 * kTileN, "scale_zero does not match codes");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const bf* sp = scale_zero.data_ptr<bf>();
  alignas(64) bf w[kTileRows * kTileK];
  int least = kNoExponent;
  for (int64_t i = 0; i < tiles; ++i) {
    dequant_int4(cp + i * kTileRows * 16, sp + i * 2 * kTileN, w);
    for (const bf v : w) least = std::min(least, exponent_of(v.x));
  }
  return least;
}

}  // namespace

// int4_gemm's product for at most kMaxRows rows, on AVX-512 in the tiles' arithmetic: the same bits, each
// weight dequantized once and used by every row at once. w_min_exponent: int4_min_exponent of these codes.
// The plain way where every product's last bit (2^(ex + ew - 14) for bfloat16 exponents ex, ew) is at least
// float32's smallest normal 2^-126: then every sum and its rounding is a multiple of it, so zero or normal.
at::Tensor int4_gemm_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                          const c10::optional<at::Tensor>& residual, int64_t w_min_exponent) {
  static const bool usable = cpu_runs_rows();
  TORCH_CHECK(usable, "the rows path needs AVX-512 with bfloat16 conversions");
  const std::pair<int64_t, int64_t> counts = tile_counts(x, codes, scale_zero);
  const int64_t nt = counts.first, kt = counts.second, n = nt * kTileN, m = x.size(0), kh = kt * kTileRows;
  TORCH_CHECK(m <= kMaxRows, "the rows path takes at most ", kMaxRows, " rows");
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const std::pair<const bf*, int64_t> residual_at = residual_rows(residual, m, n);
  const bf* res = residual_at.first;  // plain names: a lambda cannot capture a structured binding in C++17
  const int64_t ldr = residual_at.second;
  if (m == 0) return y;
  // x's even k, then its odd k, as float32 with denormals read as (signed) zero, as DAZ reads them; and the
  // least exponent of its normal values. 32 elements (16 pairs) a step: K is a multiple of 32.
  std::vector<float> xs(2 * m * kh);
  const bf* xp = x.data_ptr<bf>();
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u)), exponent = _mm512_set1_epi32(0x7F800000);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512i least = _mm512_set1_epi32(255);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < kh; i += 16) {
      const __m512i pairs = _mm512_loadu_si512(xp + r * x.stride(0) + 2 * i);
      const __m512i even = _mm512_slli_epi32(pairs, 16), odd = _mm512_and_si512(pairs, high);
      const __mmask16 even_normal = _mm512_test_epi32_mask(even, exponent);
      const __mmask16 odd_normal = _mm512_test_epi32_mask(odd, exponent);
      _mm512_storeu_si512(&xs[r * kh + i], _mm512_mask_blend_epi32(even_normal, _mm512_and_si512(even, sign), even));
      _mm512_storeu_si512(&xs[(m + r) * kh + i], _mm512_mask_blend_epi32(odd_normal, _mm512_and_si512(odd, sign), odd));
      const __m512i field_even = _mm512_srli_epi32(_mm512_and_si512(even, exponent), 23);
      const __m512i field_odd = _mm512_srli_epi32(_mm512_and_si512(odd, exponent), 23);
      least = _mm512_mask_min_epu32(least, even_normal, least, field_even);
      least = _mm512_mask_min_epu32(least, odd_normal, least, field_odd);
    }
  const int field = static_cast<int>(_mm512_reduce_min_epu32(least));
  const int x_min_exponent = field == 255 ? kNoExponent : field - 127;
  const bool plain = x_min_exponent + w_min_exponent - 14 >= -126;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const bf* sp = scale_zero.data_ptr<bf>();
  bf* yp = y.data_ptr<bf>();
  const int64_t panels = (nt + 1) / 2, codes_step = kt * kTileRows * 16, sz_step = kt * 2 * kTileN;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float c[kMaxRows * kPanelN];
    const unsigned csr = _mm_getcsr();  // this thread's, under which the tiles would dequantize
    const RowsTiles multiply = kRowsTiles[plain && (csr & conveyor::kRounding) == 0][m - 1];
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = (2 * p + 1 < nt) ? 2 : 1;
      multiply(xs.data(), kh, kt, cp + 2 * p * codes_step, sp + 2 * p * sz_step, cols, csr, c);
      for (int j = 0; j < cols; ++j)
        for (int64_t r = 0; r < m; ++r)
          write_tile(c + r * kPanelN + kTileN * j, 1, yp + r * n, n, res ? res + r * ldr : nullptr, ldr,
                     kPanelN * p + kTileN * j);
    }
  });
  return y;
}

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("int4_gemm_rows(Tensor x, Tensor codes, Tensor scale_zero, Tensor? residual, int w_min_exponent) -> Tensor");
  m.def("int4_min_exponent(Tensor codes, Tensor scale_zero) -> int");
  m.impl("int4_min_exponent", c10::DispatchKey::CPU, &int4_min_exponent);
  m.impl("int4_gemm_rows", c10::DispatchKey::CPU, &int4_gemm_rows);
}
