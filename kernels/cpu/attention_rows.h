// The AVX-512 BF16 path's rows-as-lanes layout (a prompt chunk's 8..16 tokens), included by attention_bf16.h
// inside namespace bf16: the same arithmetic per row as block_keys there, so the same bits.

// One key's scores for 16 rows, row j in lane j (qt: the rows' queries transposed, pair of dims c in qt[c]):
// the same arithmetic as dots16_rows for each row (lane l of a row's dot holds the pairs 16c + l
// summed over c in order; the 16 lane sums added pairwise, neighbours first).
template <int C>
inline __m512 dots_rows(const __m512i* qt, const int32_t* k) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int l = 0; l < 16; ++l) {
    a[l] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      a[l] = _mm512_dpbf16_ps(a[l], (__m512bh)qt[16 * c + l], (__m512bh)_mm512_set1_epi32(k[16 * c + l]));
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = _mm512_add_ps(a[2 * i], a[2 * i + 1]);
  return a[0];
}

// R rows' V update (rows of any tokens and heads; row r's weight for key x of the unit at w[r][x * 16], its
// accumulator at acc[r]) over the keys [lo, hi] in position order, 64 dims at a time, then 32.
template <int W, int R>
inline void pv_group_w(const conveyor::Params& p, const conveyor::Span& s, const float* const* w, float* const* acc,
                       const float* alpha, int64_t d, int64_t lo, int64_t hi) {
  const int64_t BS = p.BS, stride = p.Hkv * p.D, n16 = (BS + 15) / 16 * 16;
  __m512 a[R][W];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < W; ++x) a[r][x] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d + 16 * x), _mm512_set1_ps(alpha[r]));
  for (int64_t b = lo / BS; b <= hi / BS; ++b) {
    const bf* v = static_cast<const bf*>(s.v[b]) + d;
    const int64_t i1 = std::min(hi - b * BS, BS - 1);
    for (int64_t i = std::max<int64_t>(lo - b * BS, 0); i <= i1; ++i) {
      __m512 vi[W];
      for (int x = 0; x < W; ++x) vi[x] = widen16(v + i * stride + 16 * x);
      const int64_t at = (b * n16 + i) * 16;
      for (int r = 0; r < R; ++r) {
        const __m512 wi = _mm512_set1_ps(w[r][at]);
        for (int x = 0; x < W; ++x) a[r][x] = _mm512_fmadd_ps(wi, vi[x], a[r][x]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < W; ++x) _mm512_storeu_ps(acc[r] + d + 16 * x, a[r][x]);
}

template <int R>
inline void pv_group(const conveyor::Params& p, const conveyor::Span& s, const float* const* w, float* const* acc,
                     const float* alpha, int64_t lo, int64_t hi) {
  int64_t d = 0;
  for (; d + 64 <= p.D; d += 64) pv_group_w<4, R>(p, s, w, acc, alpha, d, lo, hi);
  if (d < p.D) pv_group_w<2, R>(p, s, w, acc, alpha, d, lo, hi);
}

// Rows as lanes (a prompt chunk's 16 tokens): per query head, the tokens' queries transposed once, each key's
// scores for all tokens by broadcast vdpbf16ps (no horizontal reduction), the max, exponentials and sums
// down the lanes; then each token's V update as in block_keys. Every row's arithmetic is block_keys':
// scores as above; a key a row cannot see scores -inf and weighs exactly 0, which leaves its max and sum
// unchanged (the sum of weights in block_keys' order: per lane of 16 keys across the row's blocks, then
// sum_tree); alpha by the same expf, l by the same fma. At most 16 tokens.
template <int C, bool kAmx>
void block_rows(const conveyor::Params& p, const conveyor::Span& s) {
  const int64_t G = p.G, D = p.D, BS = p.BS, n16 = (BS + 15) / 16 * 16, keys = s.nb * n16, stride = p.Hkv * D;
  thread_local std::vector<float> wt;  // [G][keys][16 tokens] scores, then weights
  if (static_cast<int64_t>(wt.size()) < G * keys * 16) wt.resize(G * keys * 16);
  int32_t lo[16], hi[16];  // the keys each token sees (offsets in the unit); lo > hi: none
  int64_t kmin = keys, kmax = -1;
  for (int64_t j = 0; j < 16; ++j) {
    int64_t a = 1, b = 0;
    if (j < s.n) conveyor::visible_keys(p, s.pos0 + j, s.b0, s.nb * BS, &a, &b);
    lo[j] = static_cast<int32_t>(a), hi[j] = static_cast<int32_t>(b);
    if (a <= b) kmin = std::min(kmin, a), kmax = std::max(kmax, b);
  }
  if (kmin > kmax) return;
  const int64_t blo = kmin / BS, bhi = kmax / BS;
  const __m512i lo_v = _mm512_loadu_si512(lo), hi_v = _mm512_loadu_si512(hi);
  float alpha[16][64];
  for (int64_t g = 0; g < G; ++g) {
    __m512i qt[8 * 16];  // [D / 2] the tokens' query pairs, token j in lane j
    for (int64_t d = 0; d < D; d += 32) {
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j < s.n ? _mm512_loadu_si512(static_cast<const bf*>(s.q) + j * p.q_row + g * p.q_head + d)
                       : _mm512_setzero_si512();
      transpose16(r);
      for (int c = 0; c < 16; ++c) qt[d / 2 + c] = r[c];
    }
    float* w = wt.data() + g * keys * 16;
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    for (int64_t b = blo; b <= bhi; ++b) {
      const int32_t* k = static_cast<const int32_t*>(s.k[b]);
      if constexpr (kAmx) amx_dots<C>(p, static_cast<const bf*>(s.k[b]), qt, w + b * n16 * 16);
      for (int64_t i = 0; i < n16; ++i) {
        const int64_t x = b * BS + i;
        __m512 sc = _mm512_set1_ps(-__builtin_inff());
        if (i < BS && x >= kmin && x <= kmax) {
          const __m512 dot = kAmx ? _mm512_loadu_ps(w + (b * n16 + i) * 16) : dots_rows<C>(qt, k + i * stride / 2);
          sc = _mm512_mul_ps(dot, _mm512_set1_ps(p.scale));
          if (p.cap > 0.f) sc = cap16(sc, p.cap);
          const __m512i xv = _mm512_set1_epi32(static_cast<int>(x));
          const __mmask16 seen = _mm512_cmple_epi32_mask(lo_v, xv) & _mm512_cmpge_epi32_mask(hi_v, xv);
          sc = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-__builtin_inff()), sc);
        }
        _mm512_storeu_ps(w + (b * n16 + i) * 16, sc);
        mx = _mm512_max_ps(mx, sc);
      }
    }
    alignas(64) float m_old[16], m_new[16], al[16];
    for (int64_t j = 0; j < 16; ++j) m_old[j] = lo[j] <= hi[j] ? s.m[j * G + g] : 0.f;
    _mm512_store_ps(m_new, _mm512_max_ps(_mm512_load_ps(m_old), mx));
    for (int64_t j = 0; j < 16; ++j) al[j] = __builtin_expf(m_old[j] - m_new[j]);
    const __m512 mv = _mm512_load_ps(m_new);
    __m512 sum[16];
    for (int i = 0; i < 16; ++i) sum[i] = _mm512_setzero_ps();
    for (int64_t x = blo * n16; x < (bhi + 1) * n16; ++x) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(w + x * 16), mv));
      _mm512_storeu_ps(w + x * 16, e);
      sum[x % 16] = _mm512_add_ps(sum[x % 16], e);
    }
    for (int i = 0; i < 8; ++i) sum[i] = _mm512_add_ps(sum[i], sum[i + 8]);
    for (int i = 0; i < 4; ++i) sum[i] = _mm512_add_ps(sum[i], sum[i + 4]);
    for (int i = 0; i < 2; ++i) sum[i] = _mm512_add_ps(sum[i], sum[i + 2]);
    alignas(64) float total[16];
    _mm512_store_ps(total, _mm512_add_ps(sum[0], sum[1]));
    for (int64_t j = 0; j < s.n; ++j) {
      if (lo[j] > hi[j]) continue;
      const int64_t r = j * G + g;
      s.m[r] = m_new[j];
      s.l[r] = __builtin_fmaf(s.l[r], al[j], total[j]);
      alpha[j][g] = al[j];
    }
  }
  if constexpr (kAmx)
    if (amx_pv(p)) return amx_pv_rows<C>(p, s, wt.data(), keys, lo, hi, kmin, kmax, alpha);
  // The V update, rows (token, head) in groups of up to 6 over the union of their keys: a key a row does
  // not see weighs +0 there, and adding +0 * v (v finite: every key of the span's range is written)
  // leaves its accumulator, never -0, unchanged.
  const float* wr[6];
  float* ar[6];
  float al[6];
  int64_t n = 0, glo = 0, ghi = 0;
  for (int64_t j = 0; j < s.n; ++j) {
    if (lo[j] > hi[j]) continue;
    for (int64_t g = 0; g < G; ++g) {
      if (n == 0) glo = lo[j], ghi = hi[j];
      glo = std::min<int64_t>(glo, lo[j]), ghi = std::max<int64_t>(ghi, hi[j]);
      wr[n] = wt.data() + g * keys * 16 + j, ar[n] = s.acc + (j * G + g) * D, al[n] = alpha[j][g];
      if (++n == 6) pv_group<6>(p, s, wr, ar, al, glo, ghi), n = 0;
    }
  }
  switch (n) {
    case 5: pv_group<5>(p, s, wr, ar, al, glo, ghi); break;
    case 4: pv_group<4>(p, s, wr, ar, al, glo, ghi); break;
    case 3: pv_group<3>(p, s, wr, ar, al, glo, ghi); break;
    case 2: pv_group<2>(p, s, wr, ar, al, glo, ghi); break;
    case 1: pv_group<1>(p, s, wr, ar, al, glo, ghi); break;
    default: break;
  }
}

