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

// Merges the partitions of each row, in partition order, into out's rows of the tokens [t0, t1).
template <typename Q>
void merge(const Call& c, const Partials& in, int64_t seq, int64_t t0, int64_t t1, Q* op, float* o) {
  const int64_t G = c.p.G, D = c.p.D;
  for (int64_t h = 0; h < c.p.Hkv; ++h)
    for (int64_t r = 0; r < (t1 - t0) * G; ++r) {
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
      Q* dst = op + (c.starts[seq] + t0 + r / G) * c.o_row + (h * G + r % G) * c.o_head;
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(o[d] * inv);
    }
}

std::vector<float>& shared_buffer() {
  static std::vector<float> buf;  // the partials of partition tasks: grown, reused across calls
  return buf;
}
