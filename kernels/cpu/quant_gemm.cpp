// Weight-only int4 GEMMs on AMX tiles: y = x @ W.T with x bfloat16 [M, K] and W stored as codes.
//
// torch's int kernels re-dequantize the weights for every few rows and multiply in float32 (about 300
// GFLOP/s at any row count), so past a few rows a quantized model was slower than its bfloat16 copy. Here
// each thread dequantizes a panel of 32 output columns once per call into bfloat16 tiles laid out the way
// TDPBF16PS reads them (pairs of k interleaved per column: "VNNI"), and multiplies every row of x against
// it on AMX. The codes are repacked at load (engine/load/amx.py) so that dequantizing a tile row is a
// straight stream: 16 bytes of nibbles become the tile row's 32 bfloat16; and so that a thread reads its
// panels' codes and scales as two sequential streams (tile_counts).
//
// A row's result depends on that row only: the panel's bits are fixed by the weights, the k order is
// fixed (tile after tile, each tile's dot product in hardware order), work is split across threads by
// output columns, never by k, and a tile holds only the call's rows (a row's sums do not depend on the
// other rows of its tile). So a token's projections have the same bits alone, in a batch of any size, or
// inside a prompt chunk (issue #30). The panel is dequantized one k tile ahead of the TDPs that read it, into
// an L1 ring (multiply_streamed), so that the vector ports could dequantize while the tile unit multiplies; on
// the AMX Xeon measured, a call of 1..32 rows still takes about the sum of the two alone (docs/performance.md,
// session 25), so the dequantization, not the TDPs, bounds decode-sized calls.
// Prompt-sized calls keep a group of dequantized panels and walk x once per group, not once per panel, and
// write each block's C tiles out while the next block's TDPs run (multiply_many): the loop order moves, the
// TDPs each C tile sees do not.
//
// The rows path (a few rows on AVX-512, the same bits) is quant_gemm_rows.cpp; what both share is
// quant_int4.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "amx_usable.h"
#include "ops.h"
#include "quant_int4.h"

namespace {

using conveyor::amx_usable;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace {

// Blocks of at most 16 rows: C tiles 0-3 (four column tiles), A tile 4, B tiles 5-7. Blocks of 17..32
// rows: C tiles 0-3 (two row blocks x two column tiles), A tiles 4-5 (the row blocks), B tiles 6-7. A and C
// tiles hold the block's rows only (a one-row call multiplies one row, not 16; a row's result does not
// depend on the other rows of its tile). Unused tiles stay unconfigured (0 rows, 0 bytes).
void configure_tiles(int64_t rows) {
  TileConfig cfg;
  const uint8_t top = static_cast<uint8_t>(std::min<int64_t>(rows, kTileRows));
  const uint8_t bottom = static_cast<uint8_t>(rows - top), b = kTileRows;
  const uint8_t narrow[8] = {top, top, top, top, top, b, b, b};
  const uint8_t wide[8] = {top, top, bottom, bottom, top, bottom, b, b};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = bottom ? wide[t] : narrow[t];
    cfg.colsb[t] = cfg.rows[t] ? 64 : 0;
  }
  // GCC's _tile_loadconfig tells the compiler it reads the config's first 8 bytes only, so the stores of
  // rows and colsb could be dropped as dead (they were, once configure_tiles was not inlined)
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

using CTiles = float[4][kTileRows * kTileN];
using TileSlots = std::array<float*, 4>;  // where store_c puts C tiles 0..3

// A block's C tiles in c's layout: column tile j of rows 0-15 in c[j], of rows 16-31 in c[2 + j].
TileSlots slots_of(CTiles& c) { return {c[0], c[1], c[2], c[3]}; }

// C tiles zeroed for a block: two (two row blocks) or one row block, `cols` column tiles.
void zero_c(bool two, int cols) {
  _tile_zero(0);
  if (cols > 1) _tile_zero(1);
  if (cols > 2 || two) _tile_zero(2);
  if (cols > 3 || (two && cols > 1)) _tile_zero(3);
}

void store_c(bool two, int cols, const TileSlots& c) {
  _tile_stored(0, c[0], kTileN * sizeof(float));
  if (cols > 1) _tile_stored(1, c[1], kTileN * sizeof(float));
  if (cols > 2 || two) _tile_stored(2, c[2], kTileN * sizeof(float));
  if (cols > 3 || (two && cols > 1)) _tile_stored(3, c[3], kTileN * sizeof(float));
}

// One k tile: at most 16 rows (at, stride in bytes) times `cols` (1..4) column tiles bt -> C tiles 0..3.
// Four C tiles are four independent chains of TDPs; a fourth column tile reuses B tile 5, which the first
// TDP has read by then.
inline void step16(const bf* at, int64_t stride, const bf* bt, int cols) {
  _tile_loadd(4, at, stride);
  _tile_loadd(5, bt, 64);
  _tile_dpbf16ps(0, 4, 5);
  if (cols > 1) {
    _tile_loadd(6, bt + kTileElems, 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  if (cols > 2) {
    _tile_loadd(7, bt + 2 * kTileElems, 64);
    _tile_dpbf16ps(2, 4, 7);
  }
  if (cols > 3) {
    _tile_loadd(5, bt + 3 * kTileElems, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

// One k tile: 17..32 rows times `cols` (1 or 2) column tiles -> C tiles j (rows 0-15) and 2 + j (the rest).
// kStreamA: x's tiles loaded with the hint to keep them out of L1 (TILELOADDT1), where x is a prompt
// chunk that passes once per panel group: so the panel, which every block of the group reads, keeps L1.
// 1.05-1.14x at 2,048 rows, gate_up 1.4x at 512 (docs/kernels.md, session 27). A hint only: the same bits.
template <bool kStreamA>
inline void step32(const bf* at, int64_t stride, const bf* bt, int cols) {
  if constexpr (kStreamA)
    _tile_stream_loadd(4, at, stride);
  else
    _tile_loadd(4, at, stride);
  _tile_loadd(6, bt, 64);
  _tile_dpbf16ps(0, 4, 6);
  if (cols == 2) {
    _tile_loadd(7, bt + kTileElems, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  if constexpr (kStreamA)
    _tile_stream_loadd(5, at + kTileRows * (stride / sizeof(bf)), stride);
  else
    _tile_loadd(5, at + kTileRows * (stride / sizeof(bf)), stride);
  _tile_dpbf16ps(2, 5, 6);
  if (cols == 2) _tile_dpbf16ps(3, 5, 7);
}

template <bool kStreamA = false>
inline void step(bool two, const bf* at, int64_t stride, const bf* bt, int cols) {
  if (two)
    step32<kStreamA>(at, stride, bt, cols);
  else
    step16(at, stride, bt, cols);
}

// float32 -> bfloat16 as ATen's convert_from_float rounds (layer_ops.cpp to_bf16): VCVTNEPS2BF16, or
// where a lane is NaN or denormal (which the instruction reads as zero) ATen's integer rounding.
inline __m256i round_bf16(__m512 v) {
  if (!_mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80)) return (__m256i)_mm512_cvtneps_pbh(v);
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)), b), 16);
  return _mm512_cvtusepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), r));
}

// One C tile of gate results and one of up results -> silu(gate) * up in y[:rows, n0 : n0 + 16]: each
// rounded to bfloat16 as write_tile writes it, then silu_and_mul's lookup, product and rounding
// (layer_ops.cpp silu_mul_lookup), so the bits of the two ops one after the other.
inline void write_silu_tile(const float* g, const float* u, int64_t rows, bf* y, int64_t ldy, int64_t n0,
                            const float* table) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m256i gate = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(g + kTileN * r));
    const __m256i up = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(u + kTileN * r));
    const __m512 s = _mm512_i32gather_ps(_mm512_cvtepu16_epi32(gate), table, 4);
    const __m512 v = _mm512_mul_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(up), 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + n0), round_bf16(v));
  }
}

// Where a block's results go: y's rows (stride ldy) from column n0, plus the residual's (null: none); or,
// in a fused call (silu: silu_table()), SiLU of the gate panel's results times its up panel's.
struct Dest {
  bf* y;
  int64_t ldy;
  const bf* res;
  int64_t ldr, n0;
  const float* silu;

  Dest rows_from(int64_t m0) const { return {y + m0 * ldy, ldy, res ? res + m0 * ldr : nullptr, ldr, n0, silu}; }
  Dest column(int64_t n) const { return {y, ldy, res, ldr, n, silu}; }
};

// One panel's C tiles (c's layout) -> y[:rows, n0 : n0 + 16 * cols], plus the residual's rows.
void write_block(const CTiles& c, int64_t rows, int cols, const Dest& d) {
  const int64_t top = std::min<int64_t>(rows, kTileRows);
  for (int j = 0; j < cols; ++j) write_tile(c[j], top, d.y, d.ldy, d.res, d.ldr, d.n0 + kTileN * j);
  if (rows > kTileRows)
    for (int j = 0; j < cols; ++j)
      write_tile(c[2 + j], rows - kTileRows, d.y + kTileRows * d.ldy, d.ldy, d.res ? d.res + kTileRows * d.ldr : nullptr,
                 d.ldr, d.n0 + kTileN * j);
}

// A gate panel's C tiles and its up panel's (c's layout each) -> silu(gate) * up in y[:rows, n0 : n0 + 32].
void write_silu_block(const CTiles& g, const CTiles& u, int64_t rows, const Dest& d) {
  const int64_t top = std::min<int64_t>(rows, kTileRows);
  for (int j = 0; j < 2; ++j) write_silu_tile(g[j], u[j], top, d.y, d.ldy, d.n0 + kTileN * j, d.silu);
  if (rows > kTileRows)
    for (int j = 0; j < 2; ++j)
      write_silu_tile(g[2 + j], u[2 + j], rows - kTileRows, d.y + kTileRows * d.ldy, d.ldy, d.n0 + kTileN * j, d.silu);
}

// A unit's results (c[0]: its panel's C tiles; in a fused call c[1] the up panel's) -> d.
void write_unit(const CTiles* c, int64_t rows, int cols, const Dest& d) {
  if (d.silu)
    write_silu_block(c[0], c[1], rows, d);
  else
    write_block(c[0], rows, cols, d);
}

// A block's C tiles, stored, and where they go: written out (converted to bfloat16, plus the residual)
// while the next block's TDPs run, so the vector ports convert while the tile unit multiplies.
struct PendingBlock {
  alignas(64) CTiles c[2];
  int64_t rows = 0;
  int cols = 0;
  Dest d{};

  void flush() {
    if (rows) write_unit(c, rows, cols, d);
    rows = 0;
  }
};

// The work of a call is split into units, each written by one epilogue: a panel (32 output columns), or
// in a fused call a gate panel u and its up panel u + half (the matrix's second half of columns).
struct Units {
  int n;  // panels a unit: 1, or 2 in a fused call
  int64_t half;
  int64_t panel(int64_t u, int i) const { return u + i * half; }
};

// One block of at most 32 rows of x (stride ldx) times a unit's dequantized panels (n of them, kt tiles
// deep, `cols` 16-column tiles side by side per k tile: at most 2 where rows > 16) -> d, written by the
// next call (or the caller's flush) through out; out's earlier block is written during this one's TDPs.
// x is read in place; *configured: the block rows the thread's tiles are configured for.
void multiply_block(const bf* x, int64_t rows, int64_t ldx, int64_t kt, const bf* const* panels, int n, int cols,
                    const Dest& d, int64_t* configured, PendingBlock& out) {
  const int64_t stride = ldx * sizeof(bf);
  if (rows != *configured) {
    out.flush();
    configure_tiles(*configured = rows);
  }
  const bool two = rows > kTileRows;
  for (int i = 0; i < n; ++i) {
    zero_c(two, cols);
    for (int64_t t = 0; t < kt; ++t) {
      step<true>(two, x + t * kTileK, stride, panels[i] + t * cols * kTileElems, cols);
      if (i == 0 && t == std::min<int64_t>(kt - 1, 2)) out.flush();
    }
    store_c(two, cols, slots_of(out.c[i]));
  }
  out.rows = rows, out.cols = cols, out.d = d;
}

// Panel p's column tiles at k tile t (read in their order, prefetched ahead) dequantized into out's places
// first, first + 1 (out: one k tile's B tiles side by side).
void dequant_step(const uint8_t* codes, const bf* sz, int64_t p, int64_t nt, int64_t kt, int64_t t, bf* out,
                  int first) {
  const int own = (2 * p + 1 < nt) ? 2 : 1;
  const int64_t last = nt * kt - 1;
  for (int j = 0; j < own; ++j) {
    const int64_t tile = 2 * p * kt + t * own + j, ahead = std::min(tile + kPrefetchTiles, last);
    for (int l = 0; l < 4; ++l) __builtin_prefetch(codes + ahead * kTileRows * 16 + 64 * l);
    __builtin_prefetch(sz + ahead * 2 * kTileN);
    dequant_int4(codes + tile * kTileRows * 16, sz + tile * 2 * kTileN, out + (first + j) * kTileElems);
  }
}

// The int4 operands of one thread's call: codes, scales, column tiles, k tiles.
struct Int4Matrix {
  const uint8_t* codes;
  const bf* sz;
  int64_t nt, kt;
};

// One block of at most 32 rows (x, stride ldx) times the panels `panels` (n of them side by side, `cols`
// column tiles in all) -> C tiles stored to c. The panels are dequantized one k tile ahead of the TDPs,
// so the dequantization (vector ports) runs beside the TDPs (the tile unit): into a two-slot ring that
// stays in L1, or, where later row blocks need the panel (keep, n = 1), into keep whole. The TDPs and their
// order are multiply_block's, so are the bits.
void multiply_streamed(const bf* x, int64_t m, int64_t ldx, const Int4Matrix& w, const int64_t* panels, int n,
                       int cols, const TileSlots& c, int64_t* configured, bf* keep) {
  alignas(64) bf ring[2][4 * kTileElems];
  if (m != *configured) configure_tiles(*configured = m);
  const bool two = m > kTileRows;
  const auto slot = [&](int64_t t) { return keep ? keep + t * cols * kTileElems : ring[t & 1]; };
  const auto dequant = [&](int64_t t) {
    for (int i = 0; i < n; ++i) dequant_step(w.codes, w.sz, panels[i], w.nt, w.kt, t, slot(t), 2 * i);
  };
  zero_c(two, cols);
  dequant(0);
  for (int64_t t = 0; t < w.kt; ++t) {
    if (t + 1 < w.kt) dequant(t + 1);
    if (keep)  // the first block of a prompt chunk (multiply_many): x streams, as in multiply_block
      step<true>(two, x + t * kTileK, ldx * sizeof(bf), slot(t), cols);
    else
      step(two, x + t * kTileK, ldx * sizeof(bf), slot(t), cols);
  }
  store_c(two, cols, c);
}

// Rows [0, m <= 32) times units [u0, u1), streamed: a call of at most 16 rows takes four column tiles at
// once (two panels, or a fused unit's gate and up panels), four independent chains of TDPs.
void multiply_few(const bf* x, int64_t m, int64_t ldx, const Int4Matrix& w, const Units& units, int64_t u0,
                  int64_t u1, const Dest& d, int64_t* configured) {
  alignas(64) CTiles c[2];
  if (units.n == 2) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t pair[2] = {units.panel(u, 0), units.panel(u, 1)};
      if (m <= kTileRows)
        multiply_streamed(x, m, ldx, w, pair, 2, 4, {c[0][0], c[0][1], c[1][0], c[1][1]}, configured, nullptr);
      else
        for (int i = 0; i < 2; ++i) multiply_streamed(x, m, ldx, w, pair + i, 1, 2, slots_of(c[i]), configured, nullptr);
      write_silu_block(c[0], c[1], m, d.column(kPanelN * u));
    }
    return;
  }
  const int64_t group = m <= kTileRows ? 2 : 1;
  for (int64_t p = u0; p < u1; p += group) {
    const int64_t end = std::min(p + group, u1), panels[2] = {p, p + 1};
    const int cols = static_cast<int>(std::min(2 * end, w.nt) - 2 * p);
    multiply_streamed(x, m, ldx, w, panels, static_cast<int>(end - p), cols, slots_of(c[0]), configured, nullptr);
    write_block(c[0], m, cols, d.column(kPanelN * p));
  }
}

// x larger than this (bytes) does not stay in a core's L2 (2 MiB here) beside the panels, and the panels
// this many bytes at most are kept at once for it (docs/kernels.md, "Prompt sizes: x walked once per panel
// group").
constexpr int64_t kXInL2 = 1 << 20, kKeptBytes = 1 << 20;

// Rows [0, m > 32) times units [u0, u1), a group of units at a time: the group's panels are dequantized
// while the first 32 rows stream past them, and kept; then each further block of 32 rows meets every unit
// of the group. Where x fits in L2 a group is one unit (its panels stay near across the blocks); where it
// does not, x walked once per panel came from L3 on every A tile load, so a group is as many units as fit
// kKeptBytes, and x is walked once per group.
void multiply_many(const bf* x, int64_t m, int64_t ldx, const Int4Matrix& w, const Units& units, int64_t u0,
                   int64_t u1, const Dest& d, int64_t* configured) {
  const int64_t panel = w.kt * 2 * kTileElems, block = 2 * kTileRows, unit = units.n * panel;
  const int64_t x_bytes = m * w.kt * kTileK * static_cast<int64_t>(sizeof(bf));
  const int64_t group = x_bytes <= kXInL2 ? 1 : std::max<int64_t>(1, kKeptBytes / (unit * sizeof(bf)));
  thread_local std::vector<bf> kept;
  if (kept.size() < static_cast<size_t>(group * unit)) kept.resize(group * unit);
  const auto cols = [&](int64_t p) { return static_cast<int>(std::min(2 * p + 2, w.nt) - 2 * p); };
  thread_local PendingBlock out;
  alignas(64) CTiles c[2];
  for (int64_t g0 = u0; g0 < u1; g0 += group) {
    const int64_t g1 = std::min(g0 + group, u1);
    const auto kept_at = [&](int64_t u, int i) { return kept.data() + (u - g0) * unit + i * panel; };
    for (int64_t u = g0; u < g1; ++u) {
      for (int i = 0; i < units.n; ++i) {
        const int64_t p = units.panel(u, i);
        multiply_streamed(x, block, ldx, w, &p, 1, cols(p), slots_of(c[i]), configured, kept_at(u, i));
      }
      write_unit(c, block, cols(u), d.column(kPanelN * u));
    }
    for (int64_t m0 = block; m0 < m; m0 += block)
      for (int64_t u = g0; u < g1; ++u) {
        const bf* panels[2] = {kept_at(u, 0), kept_at(u, units.n - 1)};
        multiply_block(x + m0 * ldx, std::min(block, m - m0), ldx, w.kt, panels, units.n, cols(u),
                       d.rows_from(m0).column(kPanelN * u), configured, out);
      }
    out.flush();
  }
}

// x @ W.T (+ residual) -> [M, N]; or, with silu, W's two halves of columns as gate and up -> [M, N / 2].
at::Tensor gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                const c10::optional<at::Tensor>& residual, bool silu) {
  TORCH_CHECK(amx_usable(), "AMX tiles are not available on this CPU");
  const std::pair<int64_t, int64_t> counts = tile_counts(x, codes, scale_zero);
  const int64_t nt = counts.first, kt = counts.second, m = x.size(0);
  TORCH_CHECK(!silu || (nt % 4 == 0 && !residual), "int4_gemm_silu: N a multiple of 64, no residual");
  const int64_t n = nt * kTileN / (silu ? 2 : 1);
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const std::pair<const bf*, int64_t> residual_at = residual_rows(residual, m, n);
  if (m == 0) return y;
  const Dest d{y.data_ptr<bf>(), n, residual_at.first, residual_at.second, 0, silu ? conveyor::silu_table() : nullptr};
  const Units units{silu ? 2 : 1, nt / 4};
  const bf* xp = x.data_ptr<bf>();
  const Int4Matrix w{codes.data_ptr<uint8_t>(), scale_zero.data_ptr<bf>(), nt, kt};
  at::parallel_for(0, silu ? nt / 4 : (nt + 1) / 2, 1, [&](int64_t u0, int64_t u1) {
    int64_t configured = 0;
    if (m <= 2 * kTileRows)
      multiply_few(xp, m, x.stride(0), w, units, u0, u1, d, &configured);
    else
      multiply_many(xp, m, x.stride(0), w, units, u0, u1, d, &configured);
    if (configured) _tile_release();
  });
  return y;
}

}  // namespace

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                     const c10::optional<at::Tensor>& residual) {
  return gemm(x, codes, scale_zero, residual, false);
}

// The gate_up projection's GEMM and SiLU x up in one pass (conveyor_cpu::int4_gemm_silu_amx): the C tiles
// of a gate panel and of its up panel meet in the epilogue, so the [M, 2I] GEMM output never goes through
// memory. The same bits as silu_and_mul(int4_gemm(x)) (write_silu_tile). Where 2I is not a multiple of 64
// (a gate panel would hold up columns), those two ops.
at::Tensor int4_gemm_silu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero) {
  if (tile_counts(x, codes, scale_zero).first % 4 != 0)
    return conveyor::silu_and_mul(gemm(x, codes, scale_zero, c10::nullopt, false));
  return gemm(x, codes, scale_zero, c10::nullopt, true);
}
#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("amx_usable() -> bool", [] { return amx_usable(); });
  m.def("int4_gemm_amx(Tensor x, Tensor codes, Tensor scale_zero, Tensor? residual=None) -> Tensor");
  m.impl("int4_gemm_amx", c10::DispatchKey::CPU, &int4_gemm);
  m.def("int4_gemm_silu_amx(Tensor x, Tensor codes, Tensor scale_zero) -> Tensor");
  m.impl("int4_gemm_silu_amx", c10::DispatchKey::CPU, &int4_gemm_silu);
}
