// The portable path of the paged attention kernel: plain C++ with GCC's vector types (8 floats), so the
// same text compiles for any x86 level. paged_attention.cpp includes it once per level inside a
// `#pragma GCC target("arch=...")` region and its own namespace (portable, avx2, avx512), so each copy
// uses only that level's instructions and runs where the CPU has them (checked at run time).
// Float32 math throughout: a bfloat16 cache is widened into scratch once per unit, the queries are widened
// and scaled. A prompt token's query heads (up to three) share each load of K and V: their scores four keys at
// a time (a decode row's eight at a time, alone: the same sums). Per row, the mask, max and exponentials eight
// keys at a time (the weights summed in eight lanes by absolute position), one online-softmax update per unit,
// and the V update with the accumulators in registers across the keys seen.

using v8 = float __attribute__((vector_size(32)));
using i8 = int __attribute__((vector_size(32)));

inline float widen_(float x) { return x; }
inline float widen_(c10::BFloat16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }

inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }
inline v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
inline float max_(float a, float b) { return a > b ? a : b; }

inline float dot(const float* a, const float* b, int64_t D) {
  v8 s0{}, s1{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    s0 += load8(a + d) * load8(b + d);
    s1 += load8(a + d + 8) * load8(b + d + 8);
  }
  for (; d + 8 <= D; d += 8) s0 += load8(a + d) * load8(b + d);
  float s = hsum(s0 + s1);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// Lanes 0-3: a's lanes (0, 1) and (2, 3) summed, then b's; lanes 4-7: the same for lanes 4-7.
inline v8 hadd8(v8 a, v8 b) {
  return __builtin_shuffle(a, b, i8{0, 2, 8, 10, 4, 6, 12, 14}) +
         __builtin_shuffle(a, b, i8{1, 3, 9, 11, 5, 7, 13, 15});
}

// acc[0:D] += sum_i w[i] * v[i * stride :][:D] over the keys given, for the dims accumulate_rows leaves (under
// 32): eight at a time, then one by one; per element the same multiply-adds in key order.
inline void accumulate_tail(float* acc, const float* w, const float* v, int64_t stride, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    v8 a0 = load8(acc + d);
    for (int64_t i = 0; i < n; ++i) a0 += splat8(w[i]) * load8(v + i * stride + d);
    store8(acc + d, a0);
  }
  for (; d < D; ++d) {
    float a = acc[d];
    for (int64_t i = 0; i < n; ++i) a += w[i] * v[i * stride + d];
    acc[d] = a;
  }
}

// exp(x) for x <= 0 within about 2e-7 relative (Cody-Waite reduction, Cephes' degree-7 polynomial, 2^n in
// the exponent bits); below -87, and for -inf (a masked key), exactly 0. Branch-free, so loops vectorise.
inline float exp_nonpositive(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return x < -87.f ? 0.f : y * scale;
}

// exp_nonpositive on eight lanes: the same operations lane by lane (the floor as a truncation moved down
// where it rounded up: exact over the range used), so the same bits. GCC leaves the scalar loop scalar
// (its selects are control flow to the vectoriser): on the AVX2 EPYC it was a fifth of the kernel.
inline v8 exp8_nonpositive(v8 x) {
  const v8 lim = splat8(-87.f);
  const i8 low = x < lim;
  const v8 xc = low ? lim : x;
  const v8 f = xc * splat8(1.44269504088896341f) + splat8(0.5f);
  const v8 t = __builtin_convertvector(__builtin_convertvector(f, i8), v8);
  const v8 n = t > f ? t - splat8(1.f) : t;
  v8 r = xc - n * splat8(0.693359375f);
  r = r + n * splat8(2.12194440e-4f);
  v8 y = splat8(1.9875691500e-4f);
  y = y * r + splat8(1.3981999507e-3f);
  y = y * r + splat8(8.3334519073e-3f);
  y = y * r + splat8(4.1665795894e-2f);
  y = y * r + splat8(1.6666665459e-1f);
  y = y * r + splat8(5.0000001201e-1f);
  y = y * (r * r) + r + splat8(1.f);
  const v8 scale = (v8)((__builtin_convertvector(n, i8) + 127) << 23);
  return low ? splat8(0.f) : y * scale;
}

// out[0:8] = q . k_i for the eight keys k_i = k + i * stride (D a multiple of 8): dots4's sums for one row,
// eight keys at a time (more cache lines in flight: a decode row's keys come from memory).
inline void dot8(const float* q, const float* k, int64_t stride, int64_t D, float* out) {
  v8 acc[8] = {};
  for (int64_t d = 0; d < D; d += 8) {
    const v8 qd = load8(q + d);
    for (int i = 0; i < 8; ++i) acc[i] += qd * load8(k + i * stride + d);
  }
  const v8 lo = hadd8(hadd8(acc[0], acc[1]), hadd8(acc[2], acc[3]));
  const v8 hi = hadd8(hadd8(acc[4], acc[5]), hadd8(acc[6], acc[7]));
  for (int i = 0; i < 4; ++i) out[i] = lo[i] + lo[i + 4], out[i + 4] = hi[i] + hi[i + 4];
}

// The scores of R rows (query heads of one token) for four keys k_i = k + i * stride (D a multiple of 8):
// each key's K loaded once for the R rows; each score's eight lanes summed over d in order, then added as
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), so a row's bits do not depend on R or its partners.
template <int R>
inline void dots4(const float* const* q, const float* k, int64_t stride, int64_t D, float* const* out) {
  v8 acc[R][4] = {};
  for (int64_t d = 0; d < D; d += 8) {
    v8 qd[R];
    for (int r = 0; r < R; ++r) qd[r] = load8(q[r] + d);
    for (int i = 0; i < 4; ++i) {
      const v8 ki = load8(k + i * stride + d);
      for (int r = 0; r < R; ++r) acc[r][i] += qd[r] * ki;
    }
  }
  for (int r = 0; r < R; ++r) {
    const v8 h = hadd8(hadd8(acc[r][0], acc[r][1]), hadd8(acc[r][2], acc[r][3]));
    for (int i = 0; i < 4; ++i) out[r][i] = h[i] + h[i + 4];
  }
}

// acc_r[0:D] += sum_i w_r[i] * v[i * stride :][:D] for R rows over the same keys: each V vector loaded once
// for the R rows; per element the same multiply-adds in key order whatever R, so the same bits.
template <int R>
inline void accumulate_rows(float* const* acc, const float* const* w, const float* v, int64_t stride, int64_t n,
                            int64_t D) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    v8 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < 4; ++x) a[r][x] = load8(acc[r] + d + 8 * x);
    for (int64_t i = 0; i < n; ++i) {
      v8 wi[R];
      for (int r = 0; r < R; ++r) wi[r] = splat8(w[r][i]);
      for (int x = 0; x < 4; ++x) {
        const v8 vx = load8(v + i * stride + d + 8 * x);
        for (int r = 0; r < R; ++r) a[r][x] += wi[r] * vx;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < 4; ++x) store8(acc[r] + d + 8 * x, a[r][x]);
  }
  for (int r = 0; r < R; ++r) accumulate_tail(acc[r] + d, w[r], v + d, stride, n, D - d);
}

// One row's weights over a unit's scored keys k_lo..k_end - 1 (scores at sr, keys lo..hi visible): the mask,
// one online-softmax update for the whole unit (m, l; acc rescaled), the weights in place of the scores. The
// weights are summed in eight lanes by absolute position (b0 + i) % 8, b0 the span's first position (a span
// may start inside a unit, at a windowed row's oldest block): keys it does not see weigh exactly 0 and add
// nothing, so the sum's bits depend on the keys it sees only.
// Inlined, as it was inside the one-row function this replaced: decode rows keep the code they ran.
__attribute__((always_inline)) inline void unit_weights(const conveyor::Params& p, int64_t b0, int64_t lo,
                                                        int64_t hi, int64_t k_lo, int64_t k_end, float* sr,
                                                        float* m, float* l, float* acc) {
  float block_max = -__builtin_inff();
  int64_t i0 = k_lo;
  if (!(p.cap > 0.f)) {  // the mask and the max eight keys at a time (a max's bits do not depend on order)
    const v8 none = splat8(-__builtin_inff());
    const i8 lane{0, 1, 2, 3, 4, 5, 6, 7};
    v8 top = none;
    for (; i0 + 8 <= k_end; i0 += 8) {
      const i8 key = lane + static_cast<int>(i0);
      const v8 score = (key >= static_cast<int>(lo)) & (key <= static_cast<int>(hi)) ? load8(sr + i0) : none;
      store8(sr + i0, score);
      top = top > score ? top : score;
    }
    for (int k = 0; k < 8; ++k) block_max = max_(block_max, top[k]);
  }
  for (int64_t i = i0; i < k_end; ++i) {
    float score = sr[i];
    if (p.cap > 0.f) score = p.cap * __builtin_tanhf(score / p.cap);
    sr[i] = i >= lo && i <= hi ? score : -__builtin_inff();
    block_max = max_(block_max, sr[i]);
  }
  const float new_max = max_(*m, block_max);
  const float alpha = __builtin_expf(*m - new_max);  // exp(-inf) = 0 on a row's first unit
  *m = new_max;
  // the weights, and their sum in eight lanes by absolute position, lanes added as hsum does
  v8 lanes{};
  int64_t i = k_lo;
  if ((b0 + k_lo) % 8 == 0)
    for (; i + 8 <= k_end; i += 8) {
      const v8 w = exp8_nonpositive(load8(sr + i) - splat8(new_max));
      store8(sr + i, w);
      lanes += w;
    }
  for (; i < k_end; ++i) {
    sr[i] = exp_nonpositive(sr[i] - new_max);
    lanes[(b0 + i) % 8] += sr[i];
  }
  *l = *l * alpha + hsum(lanes);
  if (alpha != 1.f) {
#pragma omp simd
    for (int64_t d = 0; d < p.D; ++d) acc[d] *= alpha;
  }
}

// R rows of one token (its query heads r: query q[r], scores sr[r], state m[r], l[r], acc[r]) against one
// softmax unit (the span's nb blocks, keys lo..hi of the unit visible): the scores of every key of each block
// they see (seen or not: a key's score never depends on which keys the row sees), each row's weights
// (unit_weights), then V over the keys they see in key order. K and V are loaded once for the R rows; each
// row's arithmetic is the same whatever R, so its bits are too.
template <int R>
inline void attend_rows(const conveyor::Params& p, const float* const* q, const float* const* keys, int64_t kstride,
                        const float* const* values, int64_t vstride, int64_t b0, int64_t lo, int64_t hi,
                        float* const* sr, float* const* m, float* const* l, float* const* acc) {
  const int64_t BS = p.BS, D = p.D, b_lo = lo / BS, b_hi = hi / BS;
  const int64_t k_lo = b_lo * BS, k_end = (b_hi + 1) * BS;  // the keys scored: whole blocks
  for (int64_t b = b_lo; b <= b_hi; ++b) {
    // keys in whole groups of eight: one row eight at a time, several four at a time (the same sums); the
    // rest one by one
    int64_t k4 = 0;
    if (D % 8 == 0 && R == 1)
      for (; k4 + 8 <= BS; k4 += 8) dot8(q[0], keys[b] + k4 * kstride, kstride, D, sr[0] + b * BS + k4);
    else if (D % 8 == 0)
      for (; k4 + 4 <= BS / 8 * 8; k4 += 4) {
        float* out[R];
        for (int r = 0; r < R; ++r) out[r] = sr[r] + b * BS + k4;
        dots4<R>(q, keys[b] + k4 * kstride, kstride, D, out);
      }
    for (int r = 0; r < R; ++r)
      for (int64_t i = k4; i < BS; ++i) sr[r][b * BS + i] = dot(q[r], keys[b] + i * kstride, D);
  }
  for (int r = 0; r < R; ++r) unit_weights(p, b0, lo, hi, k_lo, k_end, sr[r], m[r], l[r], acc[r]);
  for (int64_t b = b_lo; b <= b_hi; ++b) {
    const int64_t a = std::max(lo, b * BS) - b * BS, z = std::min(hi, b * BS + BS - 1) - b * BS;
    const float* w[R];
    for (int r = 0; r < R; ++r) w[r] = sr[r] + b * BS + a;
    accumulate_rows<R>(acc, w, values[b] + a * vstride, vstride, z - a + 1, D);
  }
}

// A token's query heads go through a unit together, this many at a time (their scores four keys at a time:
// 4 x 3 accumulators, three queries and a key fill AVX2's sixteen registers).
constexpr int64_t kMaxRows = 3;

// The generic paths make one online-softmax update per row per unit (the span's blocks, kUnitTokens
// positions at most): the scores of the unit's keys the row sees, then their weights and V.
template <typename Q, typename KV>
void block(const conveyor::Params& p, const conveyor::Span& s) {
  const int64_t BS = p.BS, D = p.D, G = p.G, stride = p.Hkv * D, len = s.nb * BS;
  // kf, vf [len * D] each, q [kMaxRows * D], scores [kMaxRows * len]: grown, never freed
  thread_local float* scratch = nullptr;
  thread_local int64_t capacity = 0;
  const int64_t need = 2 * len * D + kMaxRows * (D + len);
  if (capacity < need) {
    delete[] scratch;
    scratch = new float[need];
    capacity = need;
  }
  float *kf = scratch, *vf = kf + len * D, *qf = vf + len * D, *sr = qf + kMaxRows * D;
  constexpr int64_t kMaxBlocks = 64;  // a unit's blocks (kUnitTokens positions, blocks of one or more)
  const float* keys[kMaxBlocks];
  const float* values[kMaxBlocks];
  int64_t kstride = D;
  for (int64_t b = 0; b < s.nb; ++b) {
    if constexpr (sizeof(KV) == sizeof(float)) {
      keys[b] = static_cast<const float*>(s.k[b]), values[b] = static_cast<const float*>(s.v[b]), kstride = stride;
    } else {
      keys[b] = kf + b * BS * D, values[b] = vf + b * BS * D;
      if (s.pos0 + s.n - 1 < s.b0 + b * BS) continue;  // no token sees this block: do not widen it
      const KV* kb = static_cast<const KV*>(s.k[b]);
      const KV* vb = static_cast<const KV*>(s.v[b]);
      for (int64_t i = 0; i < BS; ++i)
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          kf[(b * BS + i) * D + d] = widen_(kb[i * stride + d]);
          vf[(b * BS + i) * D + d] = widen_(vb[i * stride + d]);
        }
    }
  }
  for (int64_t j = 0; j < s.n; ++j) {
    int64_t lo, hi;
    conveyor::visible_keys(p, s.pos0 + j, s.b0, len, &lo, &hi);
    if (lo > hi) continue;  // a unit after the token (causal) or before its window
    // the token's query heads in groups of at most kMaxRows, as even as they go (a decode row's alone: its
    // keys come from memory, and eight keys' lines in flight at a time beat shared loads there)
    const int64_t max_rows = s.n > 1 ? kMaxRows : 1, groups = (G + max_rows - 1) / max_rows;
    for (int64_t g0 = 0, k = 0; k < groups; ++k) {
      const int64_t rows = (G - g0) / (groups - k);
      const float* qs[kMaxRows];
      float *srs[kMaxRows], *ms[kMaxRows], *ls[kMaxRows], *accs[kMaxRows];
      for (int64_t x = 0; x < rows; ++x) {
        const int64_t g = g0 + x, r = j * G + g;
        const Q* qr = static_cast<const Q*>(s.q) + j * p.q_row + g * p.q_head;
        float* qx = qf + x * D;
        for (int64_t d = 0; d < D; ++d) qx[d] = widen_(qr[d]) * p.scale;
        qs[x] = qx, srs[x] = sr + x * len, ms[x] = s.m + r, ls[x] = s.l + r, accs[x] = s.acc + r * D;
      }
      switch (rows) {
        case 3: attend_rows<3>(p, qs, keys, kstride, values, kstride, s.b0, lo, hi, srs, ms, ls, accs); break;
        case 2: attend_rows<2>(p, qs, keys, kstride, values, kstride, s.b0, lo, hi, srs, ms, ls, accs); break;
        default: attend_rows<1>(p, qs, keys, kstride, values, kstride, s.b0, lo, hi, srs, ms, ls, accs); break;
      }
      g0 += rows;
    }
  }
}
