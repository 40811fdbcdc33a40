// What the int4 GEMM's two paths share (quant_gemm.cpp: AMX tiles; quant_gemm_rows.cpp: a few rows on
// AVX-512 with the tiles' bits): the tile shape, the packed layout, and the dequantization both run, so
// both see the same bfloat16 weights.
//
// Weight values: w = (q - 8) * scale + zero (torch's int4 convention, scale and zero per 32 k and per
// column, bfloat16), computed in float32 and rounded once to bfloat16, as the packed bfloat16 copies of
// the dequantized matrices hold them.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <immintrin.h>

#include <cstdint>
#include <utility>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace {

constexpr int kTileRows = 16;  // rows of an A or C tile; k pairs of a B tile
constexpr int kTileK = 32;     // bfloat16 along k in one A row (64 bytes)
constexpr int kTileN = 16;     // output columns of one B / C tile
constexpr int kPanelN = 32;    // output columns a task dequantizes at once: two B tiles
constexpr int kTileElems = kTileRows * kTileK;  // bfloat16 in one B tile

using bf = c10::BFloat16;

// Lane i of the per-column value v[16] for tile-row elements 0..15 (lo: columns 0..7, each twice) or
// 16..31 (hi: columns 8..15): element e of a tile row is column e / 2, k parity e % 2.
inline void pair_lanes(__m512 v, __m512* lo, __m512* hi) {
  const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  *lo = _mm512_permutexvar_ps(first, v);
  *hi = _mm512_permutexvar_ps(_mm512_add_epi32(first, _mm512_set1_epi32(8)), v);
}

inline __m512 widen16(const bf* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One int4 B tile (16 columns x 32 k) -> bfloat16 VNNI [16 k pairs][32], a tile row at a time. codes: 16
// rows of 16 bytes, byte j holding element j (low nibble) and element 16 + j (high); sz: scale[16],
// zero[16] bfloat16. The tiles and the rows path both dequantize with this code, so with the same bits.
struct Int4Tile {
  __m512 s_lo, s_hi, l_lo, l_hi;
  const uint8_t* codes;

  Int4Tile(const uint8_t* c, const bf* sz) : codes(c) {
    const __m512 scale = widen16(sz), zero = widen16(sz + kTileN);
    const __m512 low = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero);  // q * scale + low
    pair_lanes(scale, &s_lo, &s_hi);
    pair_lanes(low, &l_lo, &l_hi);
  }

  // Tile row r (k pair r): element e = column e / 2 at k parity e % 2; as dwords, column i's even k in
  // the low half, its odd k in the high half.
  __m512i row(int r) const {
    // q as float32 by a lookup: vpermps reads only an index's low 4 bits, so the low nibble needs no mask
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r)));
    const __m512 q_lo = _mm512_permutexvar_ps(bytes, values);
    const __m512 q_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(q_hi, s_hi, l_hi), _mm512_fmadd_ps(q_lo, s_lo, l_lo));
  }
};

inline void dequant_int4(const uint8_t* codes, const bf* sz, bf* out) {
  const Int4Tile tile(codes, sz);
  for (int r = 0; r < kTileRows; ++r) _mm512_storeu_si512(out + 32 * r, tile.row(r));
}

// C tile (16 x 16 float32 in c) -> rows [0, rows) of y's columns [n0, n0 + 16), plus the residual's.
inline void write_tile(const float* c, int64_t rows, bf* y, int64_t ldy, const bf* res, int64_t ldr, int64_t n0) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v = _mm512_loadu_ps(c + kTileN * r);
    if (res) v = _mm512_add_ps(v, widen16(res + r * ldr + n0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + n0), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// The residual added to y (null where none), checked against y's [M, N]; -> its rows and their stride.
std::pair<const bf*, int64_t> residual_rows(const c10::optional<at::Tensor>& residual, int64_t m, int64_t n) {
  if (!residual.has_value()) return {nullptr, 0};
  TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->size(0) == m && residual->size(1) == n &&
              residual->stride(1) == 1, "residual: bfloat16 [M, N] rows");
  return {residual->data_ptr<bf>(), residual->stride(0)};
}

// The tiles of a matrix (16 columns x 32 k each) in the order both kernels read them (pack_int4 in
// engine/load/amx.py): panel by panel (32 columns; the last one 16 where N / 16 is odd), within a panel
// k tile by k tile, within a k tile its column tiles side by side. So a thread's panels are one sequential
// stream of codes and one of scales. codes uint8 [N/16 * K/32, 256]; scale_zero bfloat16 [N/16 * K/32, 2,
// 16]. -> (column tiles, k tiles).
std::pair<int64_t, int64_t> tile_counts(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bfloat16 [M, K] rows");
  TORCH_CHECK(codes.is_contiguous() && scale_zero.is_contiguous() && scale_zero.scalar_type() == at::kBFloat16);
  const int64_t kt = x.size(1) / kTileK, tiles = codes.size(0);
  TORCH_CHECK(x.size(1) % kTileK == 0 && kt > 0 && tiles % kt == 0 && codes.dim() == 2 &&
              codes.size(1) == kTileRows * 16 && scale_zero.numel() == tiles * 2 * kTileN, "codes do not match x");
  return {tiles / kt, kt};
}

// Tiles the kernels prefetch ahead of the one they dequantize (2 KiB of codes): the hardware prefetchers
// stop at each 4 KiB page. 6 to 16 ran alike over SmolLM2's shapes; 0 and 4 read slower (docs/kernels.md).
constexpr int64_t kPrefetchTiles = 8;

}  // namespace
#pragma GCC pop_options
