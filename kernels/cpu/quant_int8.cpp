// Weight-only int8 GEMMs (one scale per output column, Int8Linear; the tied LM head among them) on AMX
// tiles, and on AVX-512 with the tiles' bits (the rows path: a few rows on AMX CPUs, every row count on CPUs
// with AVX-512 BF16 and no AMX): the int4 kernels' design (quant_gemm.cpp, quant_gemm_rows.cpp) for int8
// codes.
//
// y[r, n] = bfloat16((sum_k x[r, k] * q[n, k]) * scale[n]). An int8 code is exact in bfloat16 (|q| <= 127
// needs 7 bits), so a tile is dequantized by conversion alone and the scale multiplies each column's
// float32 sum once, after the last k tile. Before this the head ran on a padded, packed bfloat16 copy of
// the dequantized matrix (2 bytes a weight read per step); here 1.
//
// A row's result depends on that row only: the k order is fixed (tile after tile; within a tile
// TDPBF16PS's even and odd chains), work is split by output columns, never by k, and a tile holds only
// the call's rows. The rows path runs exactly TDPBF16PS's FMAs (quant_gemm_rows.cpp's header) under
// MXCSR's DAZ and FTZ with rounding to nearest even, as the tile unit computes whatever MXCSR says; the
// scaling and the conversion to bfloat16 run under the caller's MXCSR on both paths. So the two paths are
// interchangeable row by row (docs/kernels.md, "The int8 GEMM on AMX tiles").
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "amx_usable.h"
#include "quant_int4.h"
#include "tile_csr.h"

namespace {

constexpr int kCodesPerTile = kTileRows * kTileK;  // int8 codes of one B tile: 16 rows of 32
// The rows the rows path takes at once (a chunk): from 6 its sums spill (the head's 49,152 x 576 on the AMX
// Xeon, 2 threads: 0.28 ms a row at 5 rows, 0.36-0.42 at 6-8).
constexpr int kRowsMax = 5;


struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Operands of a call: codes in tile_counts's order ([tiles, 512] int8, amx.pack_int8), scales [N].
struct Int8Matrix {
  const int8_t* codes;
  const float* scale;
  int64_t nt, kt;
};

// codes [N/16 * K/32, 512] int8 and scale [N] float32 checked against x [M, K] -> (column tiles, k tiles).
Int8Matrix int8_operands(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bfloat16 [M, K] rows");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kChar && codes.dim() == 2 &&
              codes.size(1) == kCodesPerTile, "codes: int8 [tiles, 512]");
  const int64_t kt = x.size(1) / kTileK, tiles = codes.size(0);
  TORCH_CHECK(x.size(1) % kTileK == 0 && kt > 0 && tiles % kt == 0, "codes do not match x");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == tiles / kt * kTileN,
              "scale: float32 [N]");
  return {codes.data_ptr<int8_t>(), scale.data_ptr<float>(), tiles / kt, kt};
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace {

// One tile row of codes (32 bytes, element e = column e / 2 at k parity e % 2) -> its 32 bfloat16, exact.
inline __m512i int8_row(const int8_t* row) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// float32 sums c[rows][16] of column tile j -> y's rows, times the columns' scales, as bfloat16.
inline void write_scaled(const float* c, int64_t ldc, int64_t rows, const float* scale, bf* y, int64_t ldy) {
  const __m512 s = _mm512_loadu_ps(scale);
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(c + r * ldc), s)));
}

// Blocks of at most 32 rows: C tiles 0-1 (rows 0-15, two column tiles) and 2-3 (the rest), A tiles 4 (rows
// 0-15) and 5 (the rest), B tiles 6-7; A and C tiles hold the block's rows only, unused ones stay empty.
void configure_tiles(int64_t rows) {
  TileConfig cfg;
  const uint8_t top = static_cast<uint8_t>(std::min<int64_t>(rows, kTileRows)), bottom = static_cast<uint8_t>(rows - top);
  for (int t : {0, 1, 4}) cfg.rows[t] = top, cfg.colsb[t] = 64;
  for (int t : {2, 3, 5}) cfg.rows[t] = bottom, cfg.colsb[t] = bottom ? 64 : 0;
  for (int t : {6, 7}) cfg.rows[t] = kTileRows, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC's _tile_loadconfig declares an 8-byte read only
  _tile_loadconfig(&cfg);
}

// Panel p's k tile t (`cols` column tiles) dequantized into its place in panel, in the codes' order, the
// tiles kPrefetchTiles ahead prefetched.
void dequant_step(const Int8Matrix& w, int64_t p, int cols, int64_t t, bf* panel) {
  const int64_t last = w.nt * w.kt * kCodesPerTile - 64;
  for (int j = 0; j < cols; ++j) {
    const int64_t i = t * cols + j, at = (2 * p * w.kt + i) * kCodesPerTile;
    for (int l = 0; l < 8; ++l)
      __builtin_prefetch(w.codes + std::min<int64_t>(at + kPrefetchTiles * kCodesPerTile + 64 * l, last));
    for (int r = 0; r < kTileRows; ++r)
      _mm512_store_si512(panel + i * kTileElems + kTileK * r, int8_row(w.codes + at + kTileK * r));
  }
}

// x's rows [0, m) times panel p, 32 rows at a time where m allows (a B tile load serves both halves) -> y's
// columns [32 p, 32 p + 16 cols). The first block dequantizes the panel one k tile ahead of its TDPs (the
// vector ports convert while the tile unit multiplies) and keeps it for the later blocks; every C tile sees
// the same TDPs in the same order whatever the block.
void multiply_panel(const bf* x, int64_t m, int64_t ldx, const Int8Matrix& w, int64_t p, bf* panel, bf* y,
                    int64_t ldy, int64_t* configured) {
  const int cols = (2 * p + 1 < w.nt) ? 2 : 1;
  alignas(64) float c[4][kTileRows * kTileN];
  // 16-row blocks where 32-row ones would end on a smaller block: each change of block rows reloads the
  // tile configuration, twice a panel (48 rows ran 0.9x in 32 + 16 against 3 x 16)
  const int64_t block = (m <= 2 * kTileRows || m % (2 * kTileRows) == 0) ? 2 * kTileRows : kTileRows;
  for (int64_t m0 = 0; m0 < m; m0 += block) {
    const int64_t rows = std::min<int64_t>(block, m - m0);
    const bool two = rows > kTileRows;
    if (rows != *configured) configure_tiles(*configured = rows);
    const bf* xb = x + m0 * ldx;
    _tile_zero(0);  // tile numbers are immediates
    if (cols == 2) _tile_zero(1);
    if (two) _tile_zero(2);
    if (two && cols == 2) _tile_zero(3);
    if (m0 == 0) dequant_step(w, p, cols, 0, panel);
    for (int64_t t = 0; t < w.kt; ++t) {
      if (m0 == 0 && t + 1 < w.kt) dequant_step(w, p, cols, t + 1, panel);
      _tile_loadd(4, xb + t * kTileK, ldx * sizeof(bf));
      _tile_loadd(6, panel + t * cols * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (cols == 2) {
        _tile_loadd(7, panel + (t * 2 + 1) * kTileElems, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two) {
        _tile_loadd(5, xb + kTileRows * ldx + t * kTileK, ldx * sizeof(bf));
        _tile_dpbf16ps(2, 5, 6);
        if (cols == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], kTileN * sizeof(float));
    if (cols == 2) _tile_stored(1, c[1], kTileN * sizeof(float));
    if (two) _tile_stored(2, c[2], kTileN * sizeof(float));
    if (two && cols == 2) _tile_stored(3, c[3], kTileN * sizeof(float));
    for (int h = 0; h < (two ? 2 : 1); ++h)
      for (int j = 0; j < cols; ++j)
        write_scaled(c[2 * h + j], kTileN, std::min<int64_t>(kTileRows, rows - kTileRows * h),
                     w.scale + kPanelN * p + kTileN * j, y + (m0 + kTileRows * h) * ldy + kPanelN * p + kTileN * j, ldy);
  }
}

constexpr unsigned kTileCsr = 0x1F80 | conveyor::kDazFtz;  // all exceptions masked, DAZ and FTZ, nearest even
using conveyor::switch_csr;

// TDPBF16PS's arithmetic for M rows against panel p: xs holds x's even k [M][kh], then its odd k, as
// float32; per 32-k tile and output an FMA chain from zero over the even k and one over the odd k, in k
// order, then acc += even + odd. Called under kTileCsr, not inlined, so that no FMA moves across the
// switch. -> c[M][32].
template <int M>
__attribute__((noinline)) void rows_panel(const float* xs, int64_t kh, const Int8Matrix& w, int64_t p, int cols,
                                          float* c) {
  const float* xe = xs;
  const float* xo = xs + M * kh;
  const int8_t* codes = w.codes + 2 * p * w.kt * kCodesPerTile;
  const int64_t last = w.nt * w.kt * kCodesPerTile - 64;
  __m512 acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < w.kt; ++t) {
    const int8_t* tc = codes + t * cols * kCodesPerTile;
    const int64_t ahead = (2 * p * w.kt + t * cols + kPrefetchTiles) * kCodesPerTile;
    for (int l = 0; l < 8 * cols; ++l) __builtin_prefetch(w.codes + std::min<int64_t>(ahead + 64 * l, last));
    __m512 even[M][2], odd[M][2];
    for (int r = 0; r < M; ++r) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();
    for (int q = 0; q < kTileRows; ++q) {  // k pair q of the tile: k = 32 t + 2 q (even), + 1 (odd)
      const int64_t kp = t * kTileRows + q;
      for (int j = 0; j < 2; ++j) {
        if (j == cols) break;
        // dword i: column i's code at the even k (low half), at the odd k (high half), as int16
        const __m512i v = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tc + j * kCodesPerTile + kTileK * q)));
        const __m512 we = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16));
        const __m512 wo = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16));
        for (int r = 0; r < M; ++r) {
          even[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xe[r * kh + kp]), we, even[r][j]);
          odd[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xo[r * kh + kp]), wo, odd[r][j]);
        }
      }
    }
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < cols; ++j) acc[r][j] = _mm512_add_ps(acc[r][j], _mm512_add_ps(even[r][j], odd[r][j]));
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < cols; ++j) _mm512_storeu_ps(c + r * kPanelN + kTileN * j, acc[r][j]);
}

using RowsPanel = void (*)(const float*, int64_t, const Int8Matrix&, int64_t, int, float*);
constexpr RowsPanel kRowsPanel[kRowsMax] = {rows_panel<1>, rows_panel<2>, rows_panel<3>, rows_panel<4>,
                                            rows_panel<5>};

}  // namespace

// y = x @ W.T for int8 codes on AMX tiles, whatever the rows.
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(conveyor::amx_usable(), "AMX tiles are not available on this CPU");
  const Int8Matrix w = int8_operands(x, codes, scale);
  const int64_t m = x.size(0), n = w.nt * kTileN;
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0) return y;
  const bf* xp = x.data_ptr<bf>();
  bf* yp = y.data_ptr<bf>();
  at::parallel_for(0, (w.nt + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    std::vector<bf> storage(w.kt * 2 * kTileElems + 32);
    bf* panel = reinterpret_cast<bf*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
    int64_t configured = 0;
    for (int64_t p = p0; p < p1; ++p) multiply_panel(xp, m, x.stride(0), w, p, panel, yp, n, &configured);
    if (configured) _tile_release();
  });
  return y;
}

// int8_gemm's product on AVX-512 with the tiles' bits, any rows: chunks of at most kRowsMax rows, each code
// converted once per chunk and used by the chunk's rows at once. A row's chains are its own, so its bits do
// not depend on its chunk: a CPU with AVX-512 BF16 and no AMX gets one arithmetic at every row count.
at::Tensor int8_gemm_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "the rows path needs AVX-512 with bfloat16 conversions");
  const Int8Matrix w = int8_operands(x, codes, scale);
  const int64_t m = x.size(0), n = w.nt * kTileN, kh = w.kt * kTileRows;
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0) return y;
  // per chunk of rows [r0, r0 + rows): their even k [rows][kh], then their odd k, widened to float32 (exact;
  // DAZ reads the denormals as zero, as the tiles do); chunk r0's at 2 r0 kh
  std::vector<float> xs(2 * m * kh);
  const bf* xp = x.data_ptr<bf>();
  for (int64_t r = 0; r < m; ++r) {
    const int64_t r0 = r / kRowsMax * kRowsMax, rows = std::min<int64_t>(kRowsMax, m - r0);
    float* even = &xs[(r0 + r) * kh];  // chunk r0's at 2 r0 kh, row r its (r - r0)th
    float* odd = even + rows * kh;
    for (int64_t i = 0; i < kh; i += 16) {
      const __m512i pairs = _mm512_loadu_si512(xp + r * x.stride(0) + 2 * i);
      _mm512_storeu_si512(even + i, _mm512_slli_epi32(pairs, 16));
      _mm512_storeu_si512(odd + i, _mm512_and_si512(pairs, _mm512_set1_epi32(0xFFFF0000u)));
    }
  }
  bf* yp = y.data_ptr<bf>();
  at::parallel_for(0, (w.nt + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float c[kRowsMax * kPanelN];
    const unsigned csr = _mm_getcsr();
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = (2 * p + 1 < w.nt) ? 2 : 1;
      for (int64_t r0 = 0; r0 < m; r0 += kRowsMax) {
        const int64_t rows = std::min<int64_t>(kRowsMax, m - r0);
        switch_csr(kTileCsr);
        kRowsPanel[rows - 1](&xs[2 * r0 * kh], kh, w, p, cols, c);
        switch_csr(csr);
        for (int j = 0; j < cols; ++j)
          write_scaled(c + kTileN * j, kPanelN, rows, w.scale + kPanelN * p + kTileN * j,
                       yp + r0 * n + kPanelN * p + kTileN * j, n);
      }
    }
  });
  return y;
}
#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("int8_gemm_amx(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.def("int8_gemm_rows(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.impl("int8_gemm_amx", c10::DispatchKey::CPU, &int8_gemm);
  m.impl("int8_gemm_rows", c10::DispatchKey::CPU, &int8_gemm_rows);
}
