// The AVX-512 BF16 path: bfloat16 queries against a bfloat16 cache, scored with vdpbf16ps straight on
// the cache's rows (no widened copy), float32 softmax and V accumulation (16 lanes; the amx path's V update
// in attention_amx_pv.h). paged_attention.cpp
// includes it inside a `#pragma GCC target` region with avx512bf16, and calls it only where the CPU
// reports avx512_bf16 and the head dim is a multiple of 32.
// One call is one softmax unit (up to 64 positions, several blocks) of one KV head: one online-softmax
// update per row per unit. Spans of few tokens (decodes) score with keys as lanes (block_keys), prompt
// chunks with tokens as lanes (block_rows); both give every row the same arithmetic, so the same bits.

namespace bf16 {

using bf = c10::BFloat16;

#include "attention_amx.h"

// Spans of at least this many tokens (at most 16) take the rows-as-lanes layout; fewer, keys as lanes.
// Either gives a row the same bits.
constexpr int64_t kRowsAsLanes = 8;

// Lane i (< 8): a's lanes 2i and 2i + 1 summed; lane 8 + i: b's. Applied as a binary tree to 16 vectors
// (pairs, then fours, eights, all 16), lane i of the root is the sum of vector i's lanes, neighbours first.
inline __m512 hadd16(__m512 a, __m512 b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

// exp(x) for x <= 0, 16 lanes: the portable path's polynomial; below -87 (masked keys: -inf) exactly 0.
inline __m512 exp16(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f),
                                                        _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(e));
}

inline __m512 widen16(const bf* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

#include "attention_amx_pv.h"

// Soft-capping, lane by lane: cap * tanh(s / cap).
inline __m512 cap16(__m512 s, float cap) {
  alignas(64) float t[16];
  _mm512_store_ps(t, s);
  for (float& x : t) x = cap * __builtin_tanhf(x / cap);
  return _mm512_load_ps(t);
}

// The one order a row's 16 partial sums are added in: t[i] + t[i + 8], then + 4, + 2, + 1. Both layouts
// below use it (the keys-as-lanes one on a stored vector, the rows-as-lanes one on 16 vectors).
inline float sum_tree(const float* t) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = t[i] + t[i + 8];
  for (int i = 0; i < 4; ++i) a[i] = a[i] + a[i + 4];
  for (int i = 0; i < 2; ++i) a[i] = a[i] + a[i + 2];
  return a[0] + a[1];
}

// 16 keys' scores of R rows of one token (row r's query chunks at qv[r * C ..]), into out[r]: each K chunk
// loaded once feeds the R rows' dot products. Keys go 4 at a time and each row's lane sums are reduced as
// they come, node by node of hadd16's tree (pairs of keys, then 4, 8, 16): a row's bits do not depend on R.
template <int C, int R>
inline void dots16_rows(const __m512bh* qv, const bf* k, int64_t stride, int64_t n, __m512* out) {
  __m512 eight[R];  // each row's node of keys 0..7
  __m512 four[R];   // of keys 0..3 or 8..11
  for (int q = 0; q < 4; ++q) {
    __m512 a[R][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      for (int r = 0; r < R; ++r) a[r][i] = _mm512_setzero_ps();
      if (4 * q + i < n)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const __m512bh kc = (__m512bh)_mm512_loadu_si512(k + (4 * q + i) * stride + 32 * c);
          for (int r = 0; r < R; ++r) a[r][i] = _mm512_dpbf16_ps(a[r][i], qv[r * C + c], kc);
        }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 node = hadd16(hadd16(a[r][0], a[r][1]), hadd16(a[r][2], a[r][3]));
      if (q % 2 == 0) four[r] = node;
      else if (q == 1) eight[r] = hadd16(four[r], node);
      else out[r] = hadd16(eight[r], hadd16(four[r], node));
    }
  }
}

// 16 keys' dot products (keys i0.. of a block) -> their scores at out: scaled, capped, masked to [lo, hi].
inline void finish16(const conveyor::Params& p, __m512 d, int64_t i0, int64_t lo, int64_t hi, float* out) {
  const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i0)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __mmask16 seen = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo))) &
                         _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(hi)));
  __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(p.scale));
  if (p.cap > 0.f) s = cap16(s, p.cap);
  _mm512_storeu_ps(out, _mm512_mask_blend_ps(seen, _mm512_set1_ps(-__builtin_inff()), s));
}

// Scores of R rows of one token (row r's query at q[r * q_head]) against BS keys (sr: row r's at
// sr[r * row], padded to a multiple of 16), scaled, capped, masked to [lo, hi] (offsets in the block; lo
// may be negative, hi at most BS - 1: the padding must weigh 0).
template <int C, int R>
inline void scores(const conveyor::Params& p, const bf* q, const bf* k, int64_t lo, int64_t hi, float* sr,
                   int64_t row) {
  const int64_t stride = p.Hkv * p.D;
  __m512bh qv[R * C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) qv[r * C + c] = (__m512bh)_mm512_loadu_si512(q + r * p.q_head + 32 * c);
  for (int64_t i0 = 0; i0 < p.BS; i0 += 16) {
    __m512 d[R];
    const int64_t n = p.BS - i0;
    if (n >= 16) dots16_rows<C, R>(qv, k + i0 * stride, stride, 16, d);
    else dots16_rows<C, R>(qv, k + i0 * stride, stride, n, d);
    for (int r = 0; r < R; ++r) finish16(p, d[r], i0, lo, hi, sr + r * row + i0);
  }
}

// sr -> exp(sr - new max) in place; updates m and l; -> alpha, the factor the accumulator is rescaled by.
inline float softmax_update(float* sr, int64_t n16, float* m, float* l) {
  __m512 mx = _mm512_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < n16; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + i));
  const float bmax = _mm512_reduce_max_ps(mx);
  const float new_max = *m > bmax ? *m : bmax;
  const float alpha = __builtin_expf(*m - new_max);
  *m = new_max;
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n16; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + i), _mm512_set1_ps(new_max)));
    _mm512_storeu_ps(sr + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  alignas(64) float t[16];
  _mm512_store_ps(t, sum);
  *l = __builtin_fmaf(*l, alpha, sum_tree(t));
  return alpha;
}

// acc rows g0..g0+R-1 (R at most 4), dims [d, d + 16 * W): rescaled by alpha, plus the weighted V rows of
// the unit's keys [lo, hi] (offsets from its block 0) in position order; w: row g's weight for key i of
// block b at g * row + (b * n16 + i) * ks.
template <int W, int R>
inline void pv(const conveyor::Params& p, const conveyor::Span& s, const float* w, int64_t row, int64_t ks,
               const float* alpha, float* acc, int64_t d, int64_t lo, int64_t hi) {
  const int64_t D = p.D, BS = p.BS, stride = p.Hkv * D, n16 = (BS + 15) / 16 * 16;
  __m512 a[R][W];
  for (int g = 0; g < R; ++g)
    for (int x = 0; x < W; ++x)
      a[g][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d + 16 * x), _mm512_set1_ps(alpha[g]));
  for (int64_t b = lo / BS; b <= hi / BS; ++b) {
    const bf* v = static_cast<const bf*>(s.v[b]) + d;
    const float* wb = w + b * n16 * ks;
    const int64_t i1 = std::min(hi - b * BS, BS - 1);
    for (int64_t i = std::max<int64_t>(lo - b * BS, 0); i <= i1; ++i) {
      __m512 vi[W];
      for (int x = 0; x < W; ++x) vi[x] = widen16(v + i * stride + 16 * x);
      for (int g = 0; g < R; ++g) {
        const __m512 wi = _mm512_set1_ps(wb[g * row + i * ks]);
        for (int x = 0; x < W; ++x) a[g][x] = _mm512_fmadd_ps(wi, vi[x], a[g][x]);
      }
    }
  }
  for (int g = 0; g < R; ++g)
    for (int x = 0; x < W; ++x) _mm512_storeu_ps(acc + g * D + d + 16 * x, a[g][x]);
}

// The rows' V update over dims [d, D), 64 at a time, then 32.
template <int R>
inline void pv_rows(const conveyor::Params& p, const conveyor::Span& s, const float* w, int64_t row, int64_t ks,
                    const float* alpha, float* acc, int64_t lo, int64_t hi) {
  int64_t d = 0;
  for (; d + 64 <= p.D; d += 64) pv<4, R>(p, s, w, row, ks, alpha, acc, d, lo, hi);
  if (d < p.D) pv<2, R>(p, s, w, row, ks, alpha, acc, d, lo, hi);
}

// The V update of one token's G rows (acc: its row 0), in groups of at most 4 (each V row widened once a
// group); a row's arithmetic is the same in any group.
inline void pv_token(const conveyor::Params& p, const conveyor::Span& s, const float* w, int64_t row, int64_t ks,
                     const float* alpha, float* acc, int64_t lo, int64_t hi) {
  for (int64_t g0 = 0; g0 < p.G; g0 += 4) {
    const int64_t rows = p.G - g0 < 4 ? p.G - g0 : 4;
    const float* wg = w + g0 * row;
    float* ag = acc + g0 * p.D;
    if (rows == 4) pv_rows<4>(p, s, wg, row, ks, alpha + g0, ag, lo, hi);
    if (rows == 3) pv_rows<3>(p, s, wg, row, ks, alpha + g0, ag, lo, hi);
    if (rows == 2) pv_rows<2>(p, s, wg, row, ks, alpha + g0, ag, lo, hi);
    if (rows == 1) pv_rows<1>(p, s, wg, row, ks, alpha + g0, ag, lo, hi);
  }
}

// Keys as lanes (decode rows, short queries): one online-softmax update per row per unit: the scores of
// every unit block the row sees, one max, the exponentials, one rescale of the accumulator, then the V
// rows of the keys it sees.
// The scores of a token's G rows (q: its head 0) by the tiles, 16 heads at a time, into sr (row g at g * row);
// next: the span the thread runs next; its token 0 and the following spans' are scored in the same burst.
template <int C>
void amx_scores(const conveyor::Params& p, const conveyor::Span& s, const bf* q, int64_t lo, int64_t hi, float* sr,
                int64_t row, const conveyor::Span* next) {
  const int64_t BS = p.BS, n16 = (BS + 15) / 16 * 16;
  const int64_t rows = BS < 16 ? BS : 16, per = BS / rows;  // keys a chunk (a C tile), chunks a block
  alignas(64) float own[4 * 256];  // [chunk][key][query head]
  AmxState& st = amx_state();
  const bool fresh = st.tiles_of != q || st.tiles_call != p.call;
  for (int64_t g0 = 0; g0 < p.G; g0 += 16) {
    const int64_t nh = p.G - g0 < 16 ? p.G - g0 : 16;
    __m512i* qb = st.tiles + g0 / 16 * 8 * 16;
    for (int64_t x = lo / BS * per; x < (hi / BS + 1) * per; x += 4) {  // chunk x: block x / per
      const int64_t u_n = std::min<int64_t>(4, (hi / BS + 1) * per - x);
      const bf* keys[4];
      amx_keys(p, s, x, u_n, keys);
      const float* c = amx_found(st, q, keys[0], p.call);
      if (!c) {
        if (fresh && x == lo / BS * per)
          amx_queries<C>(q + g0 * p.q_head, p.q_head, nh, qb), st.tiles_of = q, st.tiles_call = p.call;
        if (C <= 2) _tile_loadd(5, qb, 64);
        if (C == 2) _tile_loadd(6, qb + 16, 64);
        amx_chunks<C>(p, keys, u_n, qb);
        amx_store(u_n, own);
        c = own;  // and the next spans' in the same burst, once qb is done
        if (next && x + u_n == (hi / BS + 1) * per && g0 + 16 >= p.G) amx_ahead<C>(p, next, kRowsAsLanes);
      }
      for (int64_t u = 0; u < u_n; ++u) {
        const int64_t b = (x + u) / per, i0 = (x + u) % per * rows;
        __m512i t[16];  // [query head][key]: moves bits only (three gathers measured no faster)
        for (int i = 0; i < 16; ++i) t[i] = _mm512_load_si512(c + u * 256 + i * 16);
        transpose16(t);
        for (int64_t g = 0; g < nh; ++g)
          finish16(p, _mm512_castsi512_ps(t[g]), i0, lo - b * BS, std::min(hi - b * BS, BS - 1),
                   sr + (g0 + g) * row + b * n16 + i0);
      }
    }
  }
}

template <int C, bool kAmx>
void block_keys(const conveyor::Params& p, const conveyor::Span& s) {
  const int64_t G = p.G, BS = p.BS, n16 = (BS + 15) / 16 * 16, row = s.nb * n16;
  thread_local std::vector<float> sr;  // [G][nb * n16] scores, then weights
  if (static_cast<int64_t>(sr.size()) < G * row) sr.resize(G * row);
  float alpha[64];
  for (int64_t j = 0; j < s.n; ++j) {
    int64_t lo, hi;
    conveyor::visible_keys(p, s.pos0 + j, s.b0, s.nb * BS, &lo, &hi);
    if (lo > hi) continue;
    const int64_t r0 = j * G, blo = lo / BS, bhi = hi / BS;
    if constexpr (kAmx)
      amx_scores<C>(p, s, static_cast<const bf*>(s.q) + j * p.q_row, lo, hi, sr.data(), row, j + 1 == s.n ? s.next : nullptr);
    for (int64_t g = 0; g < G && !kAmx; g += 3) {  // 3 rows per K load (SmolLM2's group); a row's bits as alone
      const bf* q = static_cast<const bf*>(s.q) + j * p.q_row + g * p.q_head;
      for (int64_t b = blo; b <= bhi; ++b) {
        const bf* k = static_cast<const bf*>(s.k[b]);
        const int64_t klo = lo - b * BS, khi = std::min(hi - b * BS, BS - 1);
        float* sg = sr.data() + g * row + b * n16;
        if (G - g >= 3) scores<C, 3>(p, q, k, klo, khi, sg, row);
        else if (G - g == 2) scores<C, 2>(p, q, k, klo, khi, sg, row);
        else scores<C, 1>(p, q, k, klo, khi, sg, row);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      alpha[g] = softmax_update(sr.data() + g * row + blo * n16, (bhi - blo + 1) * n16, s.m + r0 + g, s.l + r0 + g);
    if (kAmx && amx_pv(p)) amx_pv_token(p, s, sr.data(), row, alpha, s.acc + r0 * p.D, lo, hi);
    else pv_token(p, s, sr.data(), row, 1, alpha, s.acc + r0 * p.D, lo, hi);
  }
}

#include "attention_rows.h"

template <int C, bool kAmx>
void block_c(const conveyor::Params& p, const conveyor::Span& s) {
  if (s.n >= kRowsAsLanes) return block_rows<C, kAmx>(p, s);
  block_keys<C, kAmx>(p, s);
}

// kAmx: the "amx" path (attention_amx.h), which needs a block size under 16 or a multiple of 16, at most 64.
template <bool kAmx>
void block(const conveyor::Params& p, const conveyor::Span& s) {
  if constexpr (kAmx) amx_configure(p.BS < 16 ? p.BS : 16, p.call);
  switch (p.D / 32) {
    case 1: return block_c<1, kAmx>(p, s);
    case 2: return block_c<2, kAmx>(p, s);
    case 3: return block_c<3, kAmx>(p, s);
    case 4: return block_c<4, kAmx>(p, s);
    case 5: return block_c<5, kAmx>(p, s);
    case 6: return block_c<6, kAmx>(p, s);
    case 7: return block_c<7, kAmx>(p, s);
    default: return block_c<8, kAmx>(p, s);
  }
}

}  // namespace bf16
