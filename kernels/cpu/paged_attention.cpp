// Paged attention for short queries on the CPU: decode tokens, speculative verification and the tails
// of chunked prompts, reading K/V blocks where they lie in the cache (no gather into a buffer).
//
// One task per (sequence, partition of the context): block by block, each block read once with all of its
// KV heads side by side, it attends each KV head's G query heads, for every query of the sequence, with an
// online softmax, and leaves an unnormalised partial (max, sum, accumulator) per (KV head, query row). A
// second pass merges the partitions of each (query, head). Partitions keep both cores busy when one long
// sequence is all there is (flash-decoding).
// window > 0: a query at position p sees keys p - window + 1 .. p (sliding-window layers); softcap > 0:
// scores s become softcap * tanh(s / softcap) before the mask (Gemma 2). A float32 cache is read in place;
// a bfloat16 one is widened to float32 once per block. The inner loops use GCC's vector types (8 floats;
// -march=native picks the instructions): a block's scores eight keys at a time (eight independent
// accumulators and one transposing reduction, not a horizontal sum per key), the exponentials as one
// vectorised polynomial over the block (not a scalar std::exp per score), each row's V update with its
// accumulator in registers across the block's keys, and the next block prefetched while one is worked on
// (blocks lie anywhere in the cache, and the hardware prefetchers stop at page boundaries).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, c10::BFloat16* out) { *out = c10::BFloat16(x); }

using v8 = float __attribute__((vector_size(32)));
inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

inline float dot(const float* a, const float* b, int64_t D) {
  v8 s0{}, s1{}, s2{}, s3{};
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    s0 += load8(a + d) * load8(b + d);
    s1 += load8(a + d + 8) * load8(b + d + 8);
    s2 += load8(a + d + 16) * load8(b + d + 16);
    s3 += load8(a + d + 24) * load8(b + d + 24);
  }
  for (; d + 8 <= D; d += 8) s0 += load8(a + d) * load8(b + d);
  float s = hsum((s0 + s1) + (s2 + s3));
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// Lane i of the result: the horizontal sum of a_i. Three rounds of pairwise adds (what hadd does on x86)
// instead of eight separate horizontal sums: one vector of eight scores from eight keys' partial dot products.
inline v8 hadd8(v8 a, v8 b) {
  using i8 = int __attribute__((vector_size(32)));
  return __builtin_shuffle(a, b, i8{0, 2, 8, 10, 4, 6, 12, 14}) + __builtin_shuffle(a, b, i8{1, 3, 9, 11, 5, 7, 13, 15});
}
inline v8 reduce8(const v8* a) {
  using i8 = int __attribute__((vector_size(32)));
  const v8 lo = hadd8(hadd8(a[0], a[1]), hadd8(a[2], a[3]));  // [a0..a3 of lanes 0-3, a0..a3 of lanes 4-7]
  const v8 hi = hadd8(hadd8(a[4], a[5]), hadd8(a[6], a[7]));
  return __builtin_shuffle(lo, hi, i8{0, 1, 2, 3, 8, 9, 10, 11}) + __builtin_shuffle(lo, hi, i8{4, 5, 6, 7, 12, 13, 14, 15});
}

// out[0:8] = q . k_i for the eight keys k_i = k + i * stride (D a multiple of 8): eight independent
// accumulators, so the FMAs of different keys overlap, and one transposing reduction for all eight.
inline void dot8(const float* q, const float* k, int64_t stride, int64_t D, float* out) {
  v8 acc[8] = {};
  for (int64_t d = 0; d < D; d += 8) {
    const v8 qd = load8(q + d);
    for (int i = 0; i < 8; ++i) acc[i] += qd * load8(k + i * stride + d);
  }
  store8(out, reduce8(acc));
}

// acc[0:D] += sum_i w[i] * v[i * stride : i * stride + D], the accumulator in registers across the keys.
inline void accumulate(float* acc, const float* w, const float* v, int64_t stride, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {  // 64 dims (most head sizes) in one pass over the keys: eight accumulators
    v8 a[8];
    for (int j = 0; j < 8; ++j) a[j] = load8(acc + d + 8 * j);
    for (int64_t i = 0; i < n; ++i) {
      if (w[i] == 0.f) continue;  // a masked key: its row may be a placeholder's
      const v8 wi = splat8(w[i]);
      const float* vi = v + i * stride + d;
      for (int j = 0; j < 8; ++j) a[j] += wi * load8(vi + 8 * j);
    }
    for (int j = 0; j < 8; ++j) store8(acc + d + 8 * j, a[j]);
  }
  for (; d + 32 <= D; d += 32) {
    v8 a0 = load8(acc + d), a1 = load8(acc + d + 8), a2 = load8(acc + d + 16), a3 = load8(acc + d + 24);
    for (int64_t i = 0; i < n; ++i) {
      if (w[i] == 0.f) continue;
      const v8 wi = splat8(w[i]);
      const float* vi = v + i * stride + d;
      a0 += wi * load8(vi);
      a1 += wi * load8(vi + 8);
      a2 += wi * load8(vi + 16);
      a3 += wi * load8(vi + 24);
    }
    store8(acc + d, a0), store8(acc + d + 8, a1), store8(acc + d + 16, a2), store8(acc + d + 24, a3);
  }
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

// exp(x) for x <= 0 (scores less their running max), within about 2e-7 relative: Cody-Waite reduction to
// r in [-ln2/2, ln2/2] and Cephes' degree-7 polynomial, times 2^n built in the exponent bits. Below -87
// (and for -inf, a masked key) exactly 0. Branch-free, so the loop over a block vectorises.
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

struct Task {
  int64_t seq, part;
};

template <typename Q, typename KV>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& q_start, const at::Tensor& q_len,
         const at::Tensor& seq_len, double scale, int64_t part_tokens, int64_t window, double softcap) {
  const int64_t num_seqs = q_start.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(2), BS = k_cache.size(1), G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = q_start.data_ptr<int32_t>();
  const int32_t* qlens = q_len.data_ptr<int32_t>();
  const int32_t* lens = seq_len.data_ptr<int32_t>();
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  int64_t max_parts = 1, max_rows = 1;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t parts = std::max<int64_t>(1, (lens[s] + part_tokens - 1) / part_tokens);
    max_parts = std::max(max_parts, parts);
    max_rows = std::max<int64_t>(max_rows, qlens[s] * G);
    for (int64_t p = 0; p < parts; ++p) tasks.push_back({s, p});
  }
  // Partials per (sequence, KV head, partition, query row of the group): max, sum and accumulator.
  const int64_t slots = num_seqs * Hkv * max_parts * max_rows;
  std::vector<float> part_max(slots, -std::numeric_limits<float>::infinity()), part_sum(slots, 0.f);
  std::vector<float> part_acc(slots * D, 0.f);
  auto slot = [&](int64_t s, int64_t h, int64_t p, int64_t r) {
    return ((s * Hkv + h) * max_parts + p) * max_rows + r;
  };

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hkv * max_rows * D), kf(BS * Hkv * D), vf(BS * Hkv * D), scores(max_rows * BS);
    constexpr bool in_place = std::is_same_v<KV, float>;  // a float32 cache needs no widened copy
    const int64_t row_stride = Hkv * D;  // between a block's K (or V) rows of one head
    for (int64_t t = begin; t < end; ++t) {
      const auto [s, p] = tasks[t];
      const int64_t n_q = qlens[s], rows = n_q * G, len = lens[s], ctx = len - n_q;
      for (int64_t h = 0; h < Hkv; ++h)  // qf: [head][query row of the group][D], scaled
        for (int64_t j = 0; j < n_q; ++j)
          for (int64_t g = 0; g < G; ++g) {
            const Q* src = qp + (starts[s] + j) * q_row + (h * G + g) * q_head;
            float* dst = qf.data() + (h * max_rows + j * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]) * fscale;
          }
      int64_t first = p * part_tokens;
      const int64_t last = std::min(len, first + part_tokens);
      if (window > 0) first = std::max(first, (ctx + 1 - window) / BS * BS);  // keys no query's window holds
      for (int64_t b0 = first; b0 < last; b0 += BS - (b0 % BS)) {
        const int64_t block = tables[s * max_blocks + b0 / BS];
        const int64_t n = std::min(last, b0 - b0 % BS + BS) - b0;  // tokens of this block in range
        const KV* kb = kp + (block * BS + b0 % BS) * Hkv * D;  // n rows of every head, contiguous
        const KV* vb = vp + (block * BS + b0 % BS) * Hkv * D;
        const int64_t b1 = b0 - b0 % BS + BS;  // the next block in range: fetched while this one is worked on
        if (b1 < last) {
          const KV* kn = kp + tables[s * max_blocks + b1 / BS] * BS * Hkv * D;
          const KV* vn = vp + tables[s * max_blocks + b1 / BS] * BS * Hkv * D;
          const int64_t bytes = std::min<int64_t>(BS, last - b1) * Hkv * D * sizeof(KV);
          for (int64_t x = 0; x < bytes; x += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(kn) + x);
            __builtin_prefetch(reinterpret_cast<const char*>(vn) + x);
          }
        }
        const float* keys;
        const float* values;
        if constexpr (in_place) {
          keys = kb, values = vb;
        } else {
#pragma omp simd
          for (int64_t x = 0; x < n * Hkv * D; ++x) {
            kf[x] = widen(kb[x]);
            vf[x] = widen(vb[x]);
          }
          keys = kf.data(), values = vf.data();
        }
        for (int64_t h = 0; h < Hkv; ++h) {
          float* m = part_max.data() + slot(s, h, p, 0);
          float* l = part_sum.data() + slot(s, h, p, 0);
          float* acc = part_acc.data() + slot(s, h, p, 0) * D;
          const float* kh = keys + h * D;
          const float* vh = values + h * D;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t visible = ctx + r / G;  // query j sits at position ctx + j and sees keys <= it
            const int64_t oldest = window > 0 ? visible - window + 1 : 0;  // and, in a window, none before this
            const float* qr = qf.data() + (h * max_rows + r) * D;
            float* sr = scores.data() + r * BS;
            float block_max = -std::numeric_limits<float>::infinity();
            int64_t i8 = 0;
            if (D % 8 == 0)
              for (; i8 + 8 <= n; i8 += 8) dot8(qr, kh + i8 * row_stride, row_stride, D, sr + i8);
            for (int64_t i = i8; i < n; ++i) sr[i] = dot(qr, kh + i * row_stride, D);
            for (int64_t i = 0; i < n; ++i) {
              float score = sr[i];
              if (cap > 0.f) score = cap * std::tanh(score / cap);  // soft-capped scores (Gemma 2)
              const int64_t key = b0 + i;
              sr[i] = key <= visible && key >= oldest ? score : -std::numeric_limits<float>::infinity();
              block_max = std::max(block_max, sr[i]);
            }
            if (block_max == -std::numeric_limits<float>::infinity()) continue;  // no key of this block visible
            const float new_max = std::max(m[r], block_max);
            const float alpha = std::exp(m[r] - new_max);  // exp(-inf) = 0 on the first block
            m[r] = new_max;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; ++i) {
              sr[i] = exp_nonpositive(sr[i] - new_max);
              sum += sr[i];
            }
            l[r] = l[r] * alpha + sum;
            float* a = acc + r * D;
            if (alpha != 1.f) {
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
            }
            accumulate(a, sr, vh, row_stride, n, D);
          }
        }
      }
    }
  });

  // Merge each (sequence, query, head)'s partitions and write it in the output's dtype.
  at::parallel_for(0, num_seqs * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t s = sh / Hkv, h = sh % Hkv, n_q = qlens[s];
      const int64_t parts = std::max<int64_t>(1, (lens[s] + part_tokens - 1) / part_tokens);
      for (int64_t r = 0; r < n_q * G; ++r) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < parts; ++p) m = std::max(m, part_max[slot(s, h, p, r)]);
        float total = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t i = slot(s, h, p, r);
          if (part_sum[i] == 0.f) continue;
          const float w = std::exp(part_max[i] - m);
          total += w * part_sum[i];
          const float* a = part_acc.data() + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        Q* dst = op + (starts[s] + r / G) * o_row + (h * G + r % G) * o_head;
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) narrow(o[d] * inv, dst + d);
      }
    }
  });
}

// Writes the attention of the given sequences' query rows into out's same rows; other rows untouched.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& seq_len, double scale, int64_t part_tokens, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "q/out shapes");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out rows must have contiguous head dims");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(), "caches");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables int32");
  for (const auto* t : {&q_start, &q_len, &seq_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->size(0) == block_tables.size(0), "seqs");
  TORCH_CHECK(part_tokens > 0 && part_tokens % k_cache.size(1) == 0, "part_tokens: a multiple of the block size");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  auto go = [&](auto q_type, auto kv_type) {
    run<decltype(q_type), decltype(kv_type)>(out, q, k_cache, v_cache, block_tables, q_start, q_len, seq_len, scale,
                                             part_tokens, window, softcap);
  };
  if (qt == at::kFloat && ct == at::kFloat)
    go(float{}, float{});
  else if (qt == at::kFloat && ct == at::kBFloat16)
    go(float{}, c10::BFloat16{});
  else if (qt == at::kBFloat16 && ct == at::kFloat)
    go(c10::BFloat16{}, float{});
  else if (qt == at::kBFloat16 && ct == at::kBFloat16)
    go(c10::BFloat16{}, c10::BFloat16{});
  else
    TORCH_CHECK(false, "unsupported dtypes: q ", qt, ", cache ", ct);
}

}  // namespace

TORCH_LIBRARY(conveyor_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor q_start, Tensor q_len, Tensor seq_len, float scale, int part_tokens, int window, float softcap) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
