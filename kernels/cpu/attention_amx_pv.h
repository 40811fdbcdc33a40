// The amx path's V update (block sizes a multiple of 16): a row's weights rounded to bfloat16 times the
// cache's V rows by TDPBF16PS, 32 keys an instruction, into a sum of the unit's keys that the row's
// accumulator then takes in one FMA (acc * alpha + sum). Prompt rows (block_rows, 16 tokens of a head as the
// A tile's rows) run the tiles, 4-5x fewer instructions than 4 float32 FMAs per row and key; decode rows
// (block_keys) run TDPBF16PS's own arithmetic on AVX-512 FMAs (bench/tdpbf16ps_probe.cpp: per instruction
// and output, an FMA chain from zero over the even keys and one over the odd keys, in key order, then
// sum += even + odd, under DAZ and FTZ; 0.88-1.00x the float32 update they replace, docs/kernels.md
// version 10), so both kinds of row keep the same bits, as the scores do. The 32-key chunks sit on a grid
// of absolute positions, so a row meets the same chunks whatever its span; a key the row does not see weighs +0 (or is left out: the same
// sums), and V rows no row of the call sees are zeros in the tiles, never read from the cache.
// Included by attention_bf16.h inside namespace bf16, after widen16.

constexpr int64_t kPvKeys = 32;       // keys per TDPBF16PS: 16 pairs
constexpr int64_t kPvMaxChunks = 3;   // a unit's at most 64 keys (the amx path's blocks are at most 64)
                                      // on the 32-key grid, from a 16-key offset

inline bool amx_pv(const conveyor::Params& p) { return p.BS % 16 == 0; }

// The chunks holding the span's key offsets [x0, x1]: chunk c's key i is offset first_key(c) + i.
struct PvChunks {
  int64_t lead, first, count;
  int64_t first_key(int64_t c) const { return (first + c) * kPvKeys - lead; }
};
inline PvChunks pv_chunks(const conveyor::Span& s, int64_t x0, int64_t x1) {
  const int64_t lead = s.b0 % kPvKeys;
  return {lead, (x0 + lead) / kPvKeys, (x1 + lead) / kPvKeys - (x0 + lead) / kPvKeys + 1};
}

// 16-bit word indices 0, at, 1, at + 1, ..., 15, at + 15: words i of two sources side by side (vpermw's
// and vpermt2w's index vectors, built once at compile time).
struct alignas(64) WordIndex {
  int16_t w[32];
};
constexpr WordIndex interleaving(int16_t at) {
  WordIndex r{};
  for (int16_t i = 0; i < 16; ++i) r.w[2 * i] = i, r.w[2 * i + 1] = static_cast<int16_t>(at + i);
  return r;
}
inline constexpr WordIndex kHalves = interleaving(16);  // the two 16-word halves of one vector
inline constexpr WordIndex kSources = interleaving(32);  // the low 16 words of two vectors

// The chunk's V rows as 2C B tiles of 512 values at vt (VNNI: tile t's row i holds dims 16t..16t+15 of keys
// 2i and 2i + 1, interleaved); keys outside [x0, x1] are zeros.
template <int C>
inline void pv_v_tiles(const conveyor::Params& p, const conveyor::Span& s, int64_t key0, int64_t x0, int64_t x1,
                       bf* vt) {
  const __m512i lo = _mm512_load_si512(kSources.w), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t stride = p.Hkv * p.D;
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t a = key0 + 2 * i, b = a + 1;
    const bf* va = a >= x0 && a <= x1 ? static_cast<const bf*>(s.v[a / p.BS]) + a % p.BS * stride : nullptr;
    const bf* vb = b >= x0 && b <= x1 ? static_cast<const bf*>(s.v[b / p.BS]) + b % p.BS * stride : nullptr;
    for (int c = 0; c < C; ++c) {
      const __m512i ra = va ? _mm512_loadu_si512(va + 32 * c) : _mm512_setzero_si512();
      const __m512i rb = vb ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(vt + 2 * c * 512 + i * 32, _mm512_permutex2var_epi16(ra, lo, rb));
      _mm512_store_si512(vt + (2 * c + 1) * 512 + i * 32, _mm512_permutex2var_epi16(ra, hi, rb));
    }
  }
}

// 16 tokens' weights for the chunk's keys (w: key x's at w + x * 16, token j in lane j; keys outside [x0, x1]
// weigh 0) as an A tile at at: row j holds token j's 32 weights in key order, rounded to bfloat16.
inline void pv_a_tokens(const float* w, int64_t key0, int64_t x0, int64_t x1, bf* at) {
  const __m512i pair = _mm512_load_si512(kHalves.w);
  __m512i d[16];  // d[i] lane j: token j's weights of keys 2i, 2i + 1
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t a = key0 + 2 * i, b = a + 1;
    const __m512 wa = a >= x0 && a <= x1 ? _mm512_loadu_ps(w + a * 16) : _mm512_setzero_ps();
    const __m512 wb = b >= x0 && b <= x1 ? _mm512_loadu_ps(w + b * 16) : _mm512_setzero_ps();
    d[i] = _mm512_permutexvar_epi16(pair, (__m512i)_mm512_cvtne2ps_pbh(wb, wa));
  }
  transpose16(d);
  for (int j = 0; j < 16; ++j) _mm512_store_si512(at + j * 32, d[j]);
}

// The tiles' sums of count chunks (A tile c at at + c * 512: 16 rows of 32 weights; V tiles at vt, 2C a
// chunk), four 16-dim tiles of the head dim at a time: done(t0, nt, out) gets tiles t0..t0 + nt - 1 of the
// sums, [tile][row][16 dims] at out.
template <int C, typename Done>
inline void pv_multiply(int64_t count, const bf* at, const bf* vt, Done&& done) {
  constexpr int T = 2 * C;
  alignas(64) float out[4 * 256];
  for (int t0 = 0; t0 < T; t0 += 4) {
    const int nt = T - t0 < 4 ? T - t0 : 4;
    _tile_zero(0);
    if (nt > 1) _tile_zero(1);
    if (nt > 2) _tile_zero(2);
    if (nt > 3) _tile_zero(3);
    for (int64_t c = 0; c < count; ++c) {
      const bf* v = vt + (c * T + t0) * 512;
      _tile_loadd(4, at + c * 512, 64);
      _tile_loadd(5, v, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (nt > 1) {
        _tile_loadd(6, v + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (nt > 2) {
        _tile_loadd(7, v + 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (nt > 3) {
        _tile_loadd(5, v + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, out, 64);
    if (nt > 1) _tile_stored(1, out + 256, 64);
    if (nt > 2) _tile_stored(2, out + 512, 64);
    if (nt > 3) _tile_stored(3, out + 768, 64);
    done(t0, nt, out);
  }
}

// The V update of a prompt task's rows (block_rows): for each head g, its 16 tokens' weights (w: head g's at
// w + g * keys * 16, [key][token]) times V over the keys [kmin, kmax] on the tiles, then each row's
// acc = acc * alpha + sum (tokens with lo > hi see none of the unit and keep theirs).
template <int C>
void amx_pv_rows(const conveyor::Params& p, const conveyor::Span& s, const float* w, int64_t keys,
                 const int32_t* lo, const int32_t* hi, int64_t kmin, int64_t kmax, const float (*alpha)[64]) {
  constexpr int T = 2 * C;  // 16-dim tiles of the head dim
  alignas(64) thread_local bf vt[kPvMaxChunks * T * 512];
  alignas(64) bf at[kPvMaxChunks * 512];
  const PvChunks ch = pv_chunks(s, kmin, kmax);
  for (int64_t c = 0; c < ch.count; ++c) pv_v_tiles<C>(p, s, ch.first_key(c), kmin, kmax, vt + c * T * 512);
  for (int64_t g = 0; g < p.G; ++g) {
    for (int64_t c = 0; c < ch.count; ++c) pv_a_tokens(w + g * keys * 16, ch.first_key(c), kmin, kmax, at + c * 512);
    pv_multiply<C>(ch.count, at, vt, [&](int t0, int nt, const float* out) {
      for (int64_t j = 0; j < s.n; ++j) {
        if (lo[j] > hi[j]) continue;
        float* acc = s.acc + (j * p.G + g) * p.D + 16 * t0;
        const __m512 al = _mm512_set1_ps(alpha[j][g]);
        for (int t = 0; t < nt; ++t)
          _mm512_storeu_ps(acc + 16 * t, _mm512_fmadd_ps(_mm512_loadu_ps(acc + 16 * t), al,
                                                         _mm512_load_ps(out + t * 256 + j * 16)));
      }
    });
  }
}

// TDPBF16PS's sums for R rows of one token over dims [d, d + 16 W), keys [lo, hi] of the unit: w (row r's
// rounded weight of key x at w[r * row + x]) added to sums[r * D + d ..], which start at zero. A chunk's even
// keys' chains, then its odd keys', each V row widened once for the R rows. Runs under tile_csr.
template <int W, int R>
__attribute__((noinline)) void pv_chains(const conveyor::Params& p, const conveyor::Span& s, const float* w,
                                         int64_t row, int64_t lo, int64_t hi, int64_t d, float* sums) {
  const int64_t stride = p.Hkv * p.D;
  const PvChunks ch = pv_chunks(s, lo, hi);
  for (int64_t c = 0; c < ch.count; ++c) {
    const int64_t key0 = ch.first_key(c), x0 = std::max(lo, key0), x1 = std::min(hi, key0 + kPvKeys - 1);
    alignas(64) float even[R][W][16];
    for (int odd = 0; odd < 2; ++odd) {  // the even keys' chains, then the odd keys'
      __m512 a[R][W];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < W; ++h) a[r][h] = _mm512_setzero_ps();
      for (int64_t x = x0 + ((x0 - key0) % 2 != odd); x <= x1; x += 2) {
        const bf* v = static_cast<const bf*>(s.v[x / p.BS]) + x % p.BS * stride + d;
        __m512 vv[W];
        for (int h = 0; h < W; ++h) vv[h] = widen16(v + 16 * h);
        for (int r = 0; r < R; ++r) {
          const __m512 wr = _mm512_set1_ps(w[r * row + x]);
          for (int h = 0; h < W; ++h) a[r][h] = _mm512_fmadd_ps(wr, vv[h], a[r][h]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < W; ++h) {
          if (!odd) {
            _mm512_store_ps(even[r][h], a[r][h]);
            continue;
          }
          float* at = sums + r * p.D + d + 16 * h;
          const __m512 pair = _mm512_add_ps(_mm512_load_ps(even[r][h]), a[r][h]);
          _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), pair));
        }
    }
  }
}

// pv_chains over dims [0, D): 64 at a time, then 32.
template <int R>
inline void pv_chains_rows(const conveyor::Params& p, const conveyor::Span& s, const float* w, int64_t row,
                           int64_t lo, int64_t hi, float* sums) {
  int64_t d = 0;
  for (; d + 64 <= p.D; d += 64) pv_chains<4, R>(p, s, w, row, lo, hi, d, sums);
  if (d < p.D) pv_chains<2, R>(p, s, w, row, lo, hi, d, sums);
}

// The V update of one token's G rows (block_keys; w: row g's weights at w + g * row, keys [lo, hi] of the
// unit, rounded here to bfloat16 in place; acc: the token's row 0): the tiles' sums by their FMA twin, then
// acc = acc * alpha + sum as amx_pv_rows.
inline void amx_pv_token(const conveyor::Params& p, const conveyor::Span& s, float* w, int64_t row,
                         const float* alpha, float* acc, int64_t lo, int64_t hi) {
  thread_local std::vector<float> sums;
  if (static_cast<int64_t>(sums.size()) < p.G * p.D) sums.resize(p.G * p.D);
  for (int64_t g = 0; g < p.G; ++g)
    for (int64_t x = lo / 16 * 16; x <= hi; x += 16) {  // as pv_a_tokens rounds: _mm512_cvtne2ps_pbh
      const __m512i r = (__m512i)_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), _mm512_loadu_ps(w + g * row + x));
      _mm512_storeu_ps(w + g * row + x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                                              _mm512_castsi512_si256(r)), 16)));
    }
  const unsigned csr = _mm_getcsr();
  conveyor::switch_csr(conveyor::tile_csr(csr));
  std::fill(sums.begin(), sums.begin() + p.G * p.D, 0.f);
  for (int64_t g0 = 0; g0 < p.G; g0 += 3) {
    const int64_t rows = p.G - g0 < 3 ? p.G - g0 : 3;
    if (rows == 3) pv_chains_rows<3>(p, s, w + g0 * row, row, lo, hi, sums.data() + g0 * p.D);
    if (rows == 2) pv_chains_rows<2>(p, s, w + g0 * row, row, lo, hi, sums.data() + g0 * p.D);
    if (rows == 1) pv_chains_rows<1>(p, s, w + g0 * row, row, lo, hi, sums.data() + g0 * p.D);
  }
  conveyor::switch_csr(csr);
  for (int64_t g = 0; g < p.G; ++g)
    for (int64_t d = 0; d < p.D; d += 16)
      _mm512_storeu_ps(acc + g * p.D + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + g * p.D + d), _mm512_set1_ps(alpha[g]),
                                                          _mm512_loadu_ps(sums.data() + g * p.D + d)));
}
