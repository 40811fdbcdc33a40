// The partials of partition tasks (paged_attention.cpp includes this inside its anonymous namespace, after
// Call): each row's unnormalised online-softmax state per partition, and their merge in partition order.
#pragma once

// Partials of rows (head h, partition p - first, token j - t0, group member g): m, l, and acc rows of D.
struct Partials {
  float *m, *l, *acc;
  int64_t first, parts, rows;  // rows per (head, partition) = tokens * G
  int64_t at(int64_t h, int64_t p) const { return (h * parts + p - first) * rows; }
};

// Partials laid out in buf (2 + D floats a row); clear: every row to its empty state (else the caller does).
Partials carve(float* buf, const Params& p, int64_t first, int64_t parts, int64_t rows, bool clear) {
  const int64_t n = p.Hkv * parts * rows;
  const Partials out{buf, buf + n, buf + 2 * n, first, parts, rows};
  if (clear) {
    std::fill(out.m, out.m + n, -std::numeric_limits<float>::infinity());
    std::fill(out.l, out.l + n + n * p.D, 0.f);
  }
  return out;
}

// Empties the rows of one partition and KV heads [h0, h1) of a shared Partials: what a partition task owns.
void clear_part(const Partials& x, const Params& p, int64_t part, int64_t h0, int64_t h1) {
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t r = x.at(h, part);
    std::fill(x.m + r, x.m + r + x.rows, -std::numeric_limits<float>::infinity());
    std::fill(x.l + r, x.l + r + x.rows, 0.f);
    std::fill(x.acc + r * p.D, x.acc + (r + x.rows) * p.D, 0.f);
  }
}

// dst[d] = (a[d] + 0) * inv as Q, d < D.
template <typename Q>
void write_row(const float* a, float inv, int64_t D, Q* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>((a[d] + 0.f) * inv);
}

// In bfloat16, 32 values an instruction (VCVTNEPS2BF16) where none is a NaN or denormal (the instruction's
// rounding is ATen's but for those: layer_ops.cpp to_bf16), else ATen's.
template <>
void write_row(const float* a, float inv, int64_t D, c10::BFloat16* dst) {
  int64_t d = 0;
#if defined(__AVX512BF16__)
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // fpclass: quiet NaN, denormal, signalling NaN
  const __m512 zero = _mm512_setzero_ps(), scale = _mm512_set1_ps(inv);
  for (; d + 32 <= D; d += 32) {
    const __m512 lo = _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(a + d), zero), scale);
    const __m512 hi = _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(a + d + 16), zero), scale);
    if (_mm512_fpclass_ps_mask(lo, kNanOrDenormal) | _mm512_fpclass_ps_mask(hi, kNanOrDenormal)) break;
    _mm512_storeu_si512(dst + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
#endif
  for (; d < D; ++d) dst[d] = static_cast<c10::BFloat16>((a[d] + 0.f) * inv);
}

// Merges the partitions of each row, in partition order, into out's rows of the tokens [t0, t1).
// A row that sees one partition (every prompt row of a short context) takes the weight exp(0) = 1 there, so
// its sum is 0 + 1 * acc = acc + 0 (-0 becomes +0) and its total is l: written straight, the same bits
// (with write_row's rounding, 3-9% of a 2,048-token step's prompt attention, session 28).
template <typename Q>
void merge(const Call& c, const Partials& in, int64_t seq, int64_t t0, int64_t t1, Q* op, float* o) {
  const int64_t G = c.p.G, D = c.p.D;
  for (int64_t h = 0; h < c.p.Hkv; ++h)
    for (int64_t r = 0; r < (t1 - t0) * G; ++r) {
      Q* dst = op + (c.starts[seq] + t0 + r / G) * c.o_row + (h * G + r % G) * c.o_head;
      int64_t only = -1, seen = 0;
      for (int64_t p = in.first; p < in.first + in.parts; ++p)
        if (in.l[in.at(h, p) + r] != 0.f) only = in.at(h, p) + r, ++seen;
      if (seen == 1) {
        write_row(in.acc + only * D, 1.f / in.l[only], D, dst);
        continue;
      }
      float m = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t p = in.first; p < in.first + in.parts; ++p) m = std::max(m, in.m[in.at(h, p) + r]);
      std::fill(o, o + D, 0.f);
      for (int64_t p = in.first; p < in.first + in.parts; ++p) {
        const int64_t i = in.at(h, p) + r;
        if (in.l[i] == 0.f) continue;  // a partition the row does not see
        const float w = std::exp(in.m[i] - m);
        total += w * in.l[i];
        const float* a = in.acc + i * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      write_row(o, 1.f / total, D, dst);  // o is never -0 (0 + ...), so o + 0 is o
    }
}

std::vector<float>& shared_buffer() {
  static std::vector<float> buf;  // the partials of partition tasks: grown, reused across calls
  return buf;
}
