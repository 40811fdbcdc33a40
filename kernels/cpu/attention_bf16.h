// The AVX-512 BF16 path: bfloat16 queries against a bfloat16 cache, scored with vdpbf16ps straight on
// the cache's rows (no widened copy), float32 softmax and V accumulation (16 lanes). paged_attention.cpp
// includes it inside a `#pragma GCC target` region with avx512bf16, and calls it only where the CPU
// reports avx512_bf16 and the head dim is a multiple of 32.
// The G query heads of one KV head go through the block together: each key's scores for all G rows
// come from the block's K rows while they sit in L1, and each V row is widened once for all G rows.

namespace bf16 {

using bf = c10::BFloat16;

// Lane i: the sum of a[i]'s 16 lanes (a transposing reduction: 15 shuffles and adds for 16 keys).
inline __m512 hadd16(__m512 a, __m512 b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}
inline __m512 reduce16(__m512* a) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = hadd16(a[2 * i], a[2 * i + 1]);
  return a[0];
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

// 16 keys' scores of one row: key i's dot product over D in lane i (C = D / 32 chunks of 32 dims; keys
// from n on are not read and score 0).
template <int C>
inline __m512 dots16(const __m512bh* qv, const bf* k, int64_t stride, int64_t n) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    a[i] = _mm512_setzero_ps();
    if (i < n)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        a[i] = _mm512_dpbf16_ps(a[i], qv[c], (__m512bh)_mm512_loadu_si512(k + i * stride + 32 * c));
  }
  return reduce16(a);
}

// Scores of one row against BS keys (sr padded to a multiple of 16), scaled, capped, masked to [lo, hi]
// (offsets in the block; outside [0, BS) is fine).
template <int C>
inline void scores(const conveyor::Params& p, const bf* q, const bf* k, int64_t lo, int64_t hi, float* sr) {
  const int64_t stride = p.Hkv * p.D;
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int64_t i0 = 0; i0 < p.BS; i0 += 16) {
    const int64_t n = p.BS - i0;
    __m512 s = _mm512_mul_ps(n >= 16 ? dots16<C>(qv, k + i0 * stride, stride, 16)
                                     : dots16<C>(qv, k + i0 * stride, stride, n), _mm512_set1_ps(p.scale));
    if (p.cap > 0.f) {
      alignas(64) float t[16];
      _mm512_store_ps(t, s);
      for (float& x : t) x = p.cap * __builtin_tanhf(x / p.cap);
      s = _mm512_load_ps(t);
    }
    const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i0)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 seen = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo))) &
                           _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(hi)));
    _mm512_storeu_ps(sr + i0, _mm512_mask_blend_ps(seen, _mm512_set1_ps(-__builtin_inff()), s));
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
  *l = *l * alpha + _mm512_reduce_add_ps(sum);
  return alpha;
}

// acc rows g0..g0+R-1 (R at most 4), dims [d, d + 16 * W): rescaled by alpha, plus the weighted V rows of
// the unit's keys [lo, hi] (offsets from its block 0) in position order; w: row g's weights at g * row.
template <int W, int R>
inline void pv(const conveyor::Params& p, const conveyor::Span& s, const float* w, int64_t row, const float* alpha,
               float* acc, int64_t d, int64_t lo, int64_t hi) {
  const int64_t D = p.D, BS = p.BS, stride = p.Hkv * D, n16 = (BS + 15) / 16 * 16;
  __m512 a[R][W];
  for (int g = 0; g < R; ++g)
    for (int x = 0; x < W; ++x)
      a[g][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d + 16 * x), _mm512_set1_ps(alpha[g]));
  for (int64_t b = lo / BS; b <= hi / BS; ++b) {
    const bf* v = static_cast<const bf*>(s.v[b]) + d;
    const float* wb = w + b * n16;
    const int64_t i1 = std::min(hi - b * BS, BS - 1);
    for (int64_t i = std::max<int64_t>(lo - b * BS, 0); i <= i1; ++i) {
      __m512 vi[W];
      for (int x = 0; x < W; ++x) vi[x] = widen16(v + i * stride + 16 * x);
      for (int g = 0; g < R; ++g) {
        const __m512 wi = _mm512_set1_ps(wb[g * row + i]);
        for (int x = 0; x < W; ++x) a[g][x] = _mm512_fmadd_ps(wi, vi[x], a[g][x]);
      }
    }
  }
  for (int g = 0; g < R; ++g)
    for (int x = 0; x < W; ++x) _mm512_storeu_ps(acc + g * D + d + 16 * x, a[g][x]);
}

// The rows' V update over dims [d, D), 64 at a time, then 32.
template <int R>
inline void pv_rows(const conveyor::Params& p, const conveyor::Span& s, const float* w, int64_t row,
                    const float* alpha, float* acc, int64_t lo, int64_t hi) {
  int64_t d = 0;
  for (; d + 64 <= p.D; d += 64) pv<4, R>(p, s, w, row, alpha, acc, d, lo, hi);
  if (d < p.D) pv<2, R>(p, s, w, row, alpha, acc, d, lo, hi);
}

// One online-softmax update per row per unit: the scores of every unit block the row sees, one max, the
// exponentials, one rescale of the accumulator, then the V rows of the keys it sees.
template <int C>
void block_c(const conveyor::Params& p, const conveyor::Span& s) {
  const int64_t G = p.G, D = p.D, BS = p.BS, n16 = (BS + 15) / 16 * 16, row = s.nb * n16;
  thread_local float* sr = nullptr;  // [G][nb * n16] scores, then weights: grown, never freed
  thread_local int64_t capacity = 0;
  if (capacity < G * row) {
    delete[] sr;
    sr = new float[G * row];
    capacity = G * row;
  }
  float alpha[64];
  for (int64_t j = 0; j < s.n; ++j) {
    int64_t lo, hi;
    conveyor::visible_keys(p, s.pos0 + j, s.b0, s.nb * BS, &lo, &hi);
    if (lo > hi) continue;
    const int64_t r0 = j * G, blo = lo / BS, bhi = hi / BS;
    for (int64_t g = 0; g < G; ++g) {
      const bf* q = static_cast<const bf*>(s.q) + j * p.q_row + g * p.q_head;
      float* sg = sr + g * row;
      for (int64_t b = blo; b <= bhi; ++b)
        scores<C>(p, q, static_cast<const bf*>(s.k[b]), lo - b * BS, hi - b * BS, sg + b * n16);
      alpha[g] = softmax_update(sg + blo * n16, (bhi - blo + 1) * n16, s.m + r0 + g, s.l + r0 + g);
    }
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t rows = G - g0 < 4 ? G - g0 : 4;
      float* acc = s.acc + (r0 + g0) * D;
      const float* w = sr + g0 * row;
      if (rows == 4) pv_rows<4>(p, s, w, row, alpha + g0, acc, lo, hi);
      if (rows == 3) pv_rows<3>(p, s, w, row, alpha + g0, acc, lo, hi);
      if (rows == 2) pv_rows<2>(p, s, w, row, alpha + g0, acc, lo, hi);
      if (rows == 1) pv_rows<1>(p, s, w, row, alpha + g0, acc, lo, hi);
    }
  }
}

void block(const conveyor::Params& p, const conveyor::Span& s) {
  switch (p.D / 32) {
    case 1: return block_c<1>(p, s);
    case 2: return block_c<2>(p, s);
    case 3: return block_c<3>(p, s);
    case 4: return block_c<4>(p, s);
    case 5: return block_c<5>(p, s);
    case 6: return block_c<6>(p, s);
    case 7: return block_c<7>(p, s);
    default: return block_c<8>(p, s);
  }
}

}  // namespace bf16
