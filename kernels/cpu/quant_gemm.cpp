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
// output columns, never by k, and a tile holds only the call's rows (a row's sums do not depend on the other
// rows of its tile). So a token's
// projections have the same bits alone, in a batch of any size, or inside a prompt chunk (issue #30).
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
//
// Weight values: w = (q - 8) * scale + zero (torch's int4 convention, scale and zero per 32 k and per
// column, bfloat16), computed in float32 and rounded once to bfloat16, as the packed bfloat16 copies of
// the dequantized matrices hold them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace {

constexpr int kTileRows = 16;  // rows of an A or C tile; k pairs of a B tile
constexpr int kTileK = 32;     // bfloat16 along k in one A row (64 bytes)
constexpr int kTileN = 16;     // output columns of one B / C tile
constexpr int kPanelN = 32;    // output columns a task dequantizes at once: two B tiles
constexpr long kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool cpu_reports_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  if (!tile || !bf16) return false;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// The rows path (int4_gemm_rows) needs AVX-512 with bfloat16 conversions, not the tiles.
bool cpu_runs_rows() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
}

// The kernel lets a process use the tile registers only once asked (Linux 5.16+).
bool amx_usable() {
  static const bool usable = cpu_reports_amx() &&
                             syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace {

using bf = c10::BFloat16;

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

constexpr int kTileElems = kTileRows * kTileK;  // bfloat16 in one B tile
using CTiles = float[4][kTileRows * kTileN];

// C tiles zeroed / stored for a block: two (two row blocks) or one row block, `cols` column tiles.
void zero_c(bool two, int cols) {
  _tile_zero(0);
  if (cols > 1) _tile_zero(1);
  if (cols > 2 || two) _tile_zero(2);
  if (cols > 3 || (two && cols > 1)) _tile_zero(3);
}

void store_c(bool two, int cols, CTiles& c) {
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
inline void step32(const bf* at, int64_t stride, const bf* bt, int cols) {
  _tile_loadd(4, at, stride);
  _tile_loadd(6, bt, 64);
  _tile_dpbf16ps(0, 4, 6);
  if (cols == 2) {
    _tile_loadd(7, bt + kTileElems, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_loadd(5, at + kTileRows * (stride / sizeof(bf)), stride);
  _tile_dpbf16ps(2, 5, 6);
  if (cols == 2) _tile_dpbf16ps(3, 5, 7);
}

// C tiles (c, as store_c left them) -> y[:rows, n0 : n0 + 16 * cols], plus the residual's rows.
void write_block(const CTiles& c, int64_t rows, int cols, bf* y, int64_t ldy, const bf* res, int64_t ldr,
                 int64_t n0) {
  const int64_t top = std::min<int64_t>(rows, kTileRows);
  for (int j = 0; j < cols; ++j) write_tile(c[j], top, y, ldy, res, ldr, n0 + kTileN * j);
  if (rows > kTileRows)
    for (int j = 0; j < cols; ++j)
      write_tile(c[2 + j], rows - kTileRows, y + kTileRows * ldy, ldy, res ? res + kTileRows * ldr : nullptr, ldr,
                 n0 + kTileN * j);
}

// Rows [0, m) of x (stride ldx) times the dequantized panel (kt tiles deep, `cols` 16-column tiles side by
// side per k tile: at most 2 where m > 16) -> y[:, n0 : n0 + 16 * cols]. x is read in place, 32 rows a
// block; *configured: the block rows the thread's tiles are configured for.
void multiply_panel(const bf* x, int64_t m, int64_t ldx, int64_t kt, const bf* panel, int cols, bf* y,
                    int64_t ldy, const bf* res, int64_t ldr, int64_t n0, int64_t* configured) {
  alignas(64) CTiles c;
  const int64_t stride = ldx * sizeof(bf);
  for (int64_t m0 = 0; m0 < m; m0 += 2 * kTileRows) {
    const int64_t rows = std::min<int64_t>(2 * kTileRows, m - m0);
    if (rows != *configured) configure_tiles(*configured = rows);
    const bool two = rows > kTileRows;
    zero_c(two, cols);
    for (int64_t t = 0; t < kt; ++t) {
      const bf* at = x + m0 * ldx + t * kTileK;
      if (two)
        step32(at, stride, panel + t * cols * kTileElems, cols);
      else
        step16(at, stride, panel + t * cols * kTileElems, cols);
    }
    store_c(two, cols, c);
    write_block(c, rows, cols, y + m0 * ldy, ldy, res ? res + m0 * ldr : nullptr, ldr, n0);
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

// One block of at most 32 rows (x, stride ldx) times panels [p, end) (`cols` column tiles) -> y's columns
// from 32 p. The panels are dequantized one k tile ahead of the TDPs, so the dequantization (vector ports)
// runs beside the TDPs (the tile unit): into a two-slot ring that stays in L1, or, where later row blocks
// need the panel (keep), into keep whole. The TDPs and their order are multiply_panel's, so are the bits.
void multiply_streamed(const bf* x, int64_t m, int64_t ldx, const Int4Matrix& w, int64_t p, int64_t end, int cols,
                       bf* y, int64_t ldy, const bf* res, int64_t ldr, int64_t* configured, bf* keep) {
  alignas(64) bf ring[2][4 * kTileElems];
  alignas(64) CTiles c;
  if (m != *configured) configure_tiles(*configured = m);
  const bool two = m > kTileRows;
  const auto slot = [&](int64_t t) { return keep ? keep + t * cols * kTileElems : ring[t & 1]; };
  const auto dequant = [&](int64_t t) {
    for (int64_t q = p; q < end; ++q) dequant_step(w.codes, w.sz, q, w.nt, w.kt, t, slot(t), 2 * (q - p));
  };
  zero_c(two, cols);
  dequant(0);
  for (int64_t t = 0; t < w.kt; ++t) {
    if (t + 1 < w.kt) dequant(t + 1);
    if (two)
      step32(x + t * kTileK, ldx * sizeof(bf), slot(t), cols);
    else
      step16(x + t * kTileK, ldx * sizeof(bf), slot(t), cols);
  }
  store_c(two, cols, c);
  write_block(c, m, cols, y, ldy, res, ldr, kPanelN * p);
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                     const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(amx_usable(), "AMX tiles are not available on this CPU");
  const std::pair<int64_t, int64_t> counts = tile_counts(x, codes, scale_zero);
  const int64_t nt = counts.first, kt = counts.second, m = x.size(0), n = nt * kTileN;
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const std::pair<const bf*, int64_t> residual_at = residual_rows(residual, m, n);
  const bf* res = residual_at.first;  // plain names: a lambda cannot capture a structured binding in C++17
  const int64_t ldr = residual_at.second;
  if (m == 0) return y;
  const bf* xp = x.data_ptr<bf>();
  bf* yp = y.data_ptr<bf>();
  const Int4Matrix w{codes.data_ptr<uint8_t>(), scale_zero.data_ptr<bf>(), nt, kt};
  // few rows: two panels (four column tiles) multiplied at once, four independent chains of TDPs
  const int64_t group = m <= kTileRows ? 2 : 1;
  at::parallel_for(0, (nt + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    int64_t configured = 0;
    thread_local std::vector<bf> panel;  // a whole panel, for calls of several row blocks
    if (m > 2 * kTileRows && panel.size() < static_cast<size_t>(kt * 2 * kTileElems)) panel.resize(kt * 2 * kTileElems);
    for (int64_t p = p0; p < p1; p += group) {
      const int64_t end = std::min(p + group, p1);
      const int cols = static_cast<int>(std::min(2 * end, nt) - 2 * p);
      // the first 32 rows streamed; the panel, kept meanwhile, for the rest
      const int64_t first = std::min<int64_t>(m, 2 * kTileRows), rest = m - first, ldx = x.stride(0);
      multiply_streamed(xp, first, ldx, w, p, end, cols, yp, n, res, ldr, &configured, rest ? panel.data() : nullptr);
      if (rest)
        multiply_panel(xp + first * ldx, rest, ldx, kt, panel.data(), cols, yp + first * n, n,
                       res ? res + first * ldr : nullptr, ldr, kPanelN * p, &configured);
    }
    if (configured) _tile_release();
  });
  return y;
}

constexpr unsigned kDazFtz = 0x8040;    // MXCSR: denormals are zero, flush to zero
constexpr unsigned kRounding = 0x6000;  // MXCSR: the rounding mode (0: to nearest even, as the tiles round)

// The compiler does not know that MXCSR changes arithmetic and may move it across _mm_setcsr: a value
// pinned on both sides of the switch is computed before it and used only after it.
template <typename V>
inline void pin(V& v) {
  asm volatile("" : "+v"(v));
}

inline void switch_csr(unsigned csr) {
  asm volatile("" ::: "memory");
  _mm_setcsr(csr);
  asm volatile("" ::: "memory");
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
      switch_csr((csr & ~kRounding) | kDazFtz);
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
    const RowsTiles multiply = kRowsTiles[plain && (csr & kRounding) == 0][m - 1];
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

}  // namespace
#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("amx_usable() -> bool", [] { return amx_usable(); });
  m.def("int4_gemm_amx(Tensor x, Tensor codes, Tensor scale_zero, Tensor? residual=None) -> Tensor");
  m.impl("int4_gemm_amx", c10::DispatchKey::CPU, &int4_gemm);
  m.def("int4_gemm_rows(Tensor x, Tensor codes, Tensor scale_zero, Tensor? residual, int w_min_exponent) -> Tensor");
  m.def("int4_min_exponent(Tensor codes, Tensor scale_zero) -> int");
  m.impl("int4_min_exponent", c10::DispatchKey::CPU, &int4_min_exponent);
  m.impl("int4_gemm_rows", c10::DispatchKey::CPU, &int4_gemm_rows);
}
