// Weight-only int4 GEMMs on AMX tiles: y = x @ W.T with x bfloat16 [M, K] and W stored as codes.
//
// torch's int kernels re-dequantize the weights for every few rows and multiply in float32 (about 300
// GFLOP/s at any row count), so past a few rows a quantized model was slower than its bfloat16 copy. Here
// each thread dequantizes a panel of 32 output columns once per call into bfloat16 tiles laid out the way
// TDPBF16PS reads them (pairs of k interleaved per column: "VNNI"), and multiplies every row of x against
// it on AMX. The codes are repacked at load (engine/load/amx.py) so that dequantizing a tile row is a
// straight stream: 16 bytes of nibbles become the tile row's 32 bfloat16.
//
// A row's result depends on that row only: the panel's bits are fixed by the weights, the k order is
// fixed (tile after tile, each tile's dot product in hardware order), work is split across threads by
// output columns, never by k, and a partial 16-row block is computed in a zero-padded copy. So a token's
// projections have the same bits alone, in a batch of any size, or inside a prompt chunk (issue #30).
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
#include <cstring>
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

// Tiles 0-3: C (two row blocks x two column tiles), 4-5: A (two row blocks), 6-7: B (two column tiles);
// every tile 16 rows of 64 bytes.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
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

// One int4 B tile (16 columns x 32 k) -> bfloat16 VNNI [16 k pairs][32]. codes: 16 rows of 16 bytes,
// byte j holding element j (low nibble) and element 16 + j (high); sz: scale[16], zero[16] bfloat16.
inline void dequant_int4(const uint8_t* codes, const bf* sz, bf* out) {
  const __m512 scale = widen16(sz), zero = widen16(sz + kTileN);
  const __m512 low = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero);  // q * scale + low
  __m512 s_lo, s_hi, l_lo, l_hi;
  pair_lanes(scale, &s_lo, &s_hi);
  pair_lanes(low, &l_lo, &l_hi);
  const __m512i nibble = _mm512_set1_epi32(0xF);
  for (int r = 0; r < kTileRows; ++r) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r)));
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble));
    const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(q_hi, s_hi, l_hi), _mm512_fmadd_ps(q_lo, s_lo, l_lo));
    _mm512_storeu_si512(out + 32 * r, (__m512i)w);
  }
}

// C tile (16 x 16 float32 in c) -> rows [0, rows) of y's columns [n0, n0 + 16), plus the residual's.
inline void write_tile(const float* c, int64_t rows, bf* y, int64_t ldy, const bf* res, int64_t ldr, int64_t n0) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v = _mm512_loadu_ps(c + kTileN * r);
    if (res) v = _mm512_add_ps(v, widen16(res + r * ldr + n0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + n0), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Rows [0, m) of x (k elements each, stride ldx) times the panel (kt tiles deep, `cols` 16-column tiles
// side by side per k tile, each 16 x 32 bfloat16) -> y[:, n0 : n0 + 16 * cols]. Full 32-row blocks read
// x in place; the last partial block is read from tail, its zero-padded copy (same tile arithmetic).
void multiply_panel(const bf* x, int64_t m, int64_t ldx, int64_t kt, const bf* panel, int cols, bf* y,
                    int64_t ldy, const bf* res, int64_t ldr, int64_t n0, const bf* tail) {
  alignas(64) float c[4][kTileRows * kTileN];
  const int64_t a_stride = ldx * sizeof(bf), b_stride = 64;
  for (int64_t m0 = 0; m0 < m; m0 += 2 * kTileRows) {
    const int64_t rows = std::min<int64_t>(2 * kTileRows, m - m0);
    const bf* a = x + m0 * ldx;
    int64_t stride = a_stride;
    if (rows < 2 * kTileRows) {
      a = tail;
      stride = kt * kTileK * sizeof(bf);
    }
    const bool two = rows > kTileRows;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < kt; ++t) {
      const bf* at = a + t * kTileK;
      const bf* bt = panel + t * cols * kTileRows * kTileK;
      _tile_loadd(4, at, stride);
      _tile_loadd(6, bt, b_stride);
      _tile_dpbf16ps(0, 4, 6);
      if (cols == 2) {
        _tile_loadd(7, bt + kTileRows * kTileK, b_stride);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two) {
        _tile_loadd(5, at + kTileRows * (stride / sizeof(bf)), stride);
        _tile_dpbf16ps(2, 5, 6);
        if (cols == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], kTileN * sizeof(float));
    _tile_stored(1, c[1], kTileN * sizeof(float));
    _tile_stored(2, c[2], kTileN * sizeof(float));
    _tile_stored(3, c[3], kTileN * sizeof(float));
    bf* yb = y + m0 * ldy;
    const bf* rb = res ? res + m0 * ldr : nullptr;
    const int64_t top = std::min<int64_t>(rows, kTileRows);
    for (int j = 0; j < cols; ++j) write_tile(c[j], top, yb, ldy, rb, ldr, n0 + kTileN * j);
    if (two)
      for (int j = 0; j < cols; ++j)
        write_tile(c[2 + j], rows - kTileRows, yb + kTileRows * ldy, ldy, rb ? rb + kTileRows * ldr : nullptr,
                   ldr, n0 + kTileN * j);
  }
}

template <typename Dequant>
at::Tensor gemm(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& residual, Dequant dequant) {
  TORCH_CHECK(amx_usable(), "AMX tiles are not available on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bfloat16 [M, K] rows");
  const int64_t m = x.size(0), k = x.size(1), kt = k / kTileK, nt = n / kTileN;
  TORCH_CHECK(k % kTileK == 0 && n % kTileN == 0, "K must be a multiple of 32 and N of 16");
  at::Tensor y = at::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const bf* res = nullptr;
  int64_t ldr = 0;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->size(0) == m && residual->size(1) == n &&
                residual->stride(1) == 1, "residual: bfloat16 [M, N] rows");
    res = residual->data_ptr<bf>();
    ldr = residual->stride(0);
  }
  if (m == 0) return y;
  const bf* xp = x.data_ptr<bf>();
  bf* yp = y.data_ptr<bf>();
  const int64_t panels = (nt + 1) / 2, full = m / (2 * kTileRows) * (2 * kTileRows);
  std::vector<bf> tail(m > full ? 2 * kTileRows * k : 0, bf(0.f));  // the partial block, zero-padded
  for (int64_t r = full; r < m; ++r) std::memcpy(tail.data() + (r - full) * k, xp + r * x.stride(0), k * sizeof(bf));
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    thread_local std::vector<bf> panel;
    panel.resize(kt * 2 * kTileRows * kTileK);
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = (2 * p + 1 < nt) ? 2 : 1;
      for (int64_t t = 0; t < kt; ++t)
        for (int j = 0; j < cols; ++j) dequant(2 * p + j, t, panel.data() + (t * cols + j) * kTileRows * kTileK);
      multiply_panel(xp, m, x.stride(0), kt, panel.data(), cols, yp, n, res, ldr, kPanelN * p, tail.data());
    }
    _tile_release();
  });
  return y;
}

// codes uint8 [N/16, K/32, 16 * 16]; scale_zero bfloat16 [N/16, K/32, 2, 16].
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                     const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(codes.is_contiguous() && scale_zero.is_contiguous() && scale_zero.scalar_type() == at::kBFloat16);
  const int64_t nt = codes.size(0), kt = codes.size(1);
  TORCH_CHECK(x.size(1) == kt * kTileK && codes.size(2) == kTileRows * 16, "codes do not match x");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const bf* sp = scale_zero.data_ptr<bf>();
  return gemm(x, nt * kTileN, residual, [&](int64_t j, int64_t t, bf* out) {
    const int64_t tile = j * kt + t;
    dequant_int4(cp + tile * kTileRows * 16, sp + tile * 2 * kTileN, out);
  });
}

}  // namespace
#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("amx_usable() -> bool", [] { return amx_usable(); });
  m.def("int4_gemm_amx(Tensor x, Tensor codes, Tensor scale_zero, Tensor? residual=None) -> Tensor");
  m.impl("int4_gemm_amx", c10::DispatchKey::CPU, &int4_gemm);
}
