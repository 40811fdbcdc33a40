// Paged attention for short queries on the CPU: decode tokens, speculative verification and the tails
// of chunked prompts, reading K/V blocks where they lie in the cache (no gather into a buffer).
//
// One task per (sequence, KV head, partition of the context): it attends the G query heads that share
// the KV head, for every query of the sequence, over the partition's keys with an online softmax, and
// leaves an unnormalised partial (max, sum, accumulator). A second pass merges the partitions of each
// (query, head). Partitions keep both cores busy when one long sequence is all there is (flash-decoding).
// window > 0: a query at position p sees keys p - window + 1 .. p (sliding-window layers); softcap > 0:
// scores s become softcap * tanh(s / softcap) before the mask (Gemma 2). K/V rows are widened to float32
// once per token and used by every query row of the group; dot products
// and the V update are plain loops that the compiler vectorises (`omp simd`), built with -march=native.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

struct Task {
  int64_t seq, head, part;
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
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t p = 0; p < parts; ++p) tasks.push_back({s, h, p});
  }
  // Partials per (sequence, KV head, partition, query row of the group): max, sum and accumulator.
  const int64_t slots = num_seqs * Hkv * max_parts * max_rows;
  std::vector<float> part_max(slots, -std::numeric_limits<float>::infinity()), part_sum(slots, 0.f);
  std::vector<float> part_acc(slots * D, 0.f);
  auto slot = [&](int64_t s, int64_t h, int64_t p, int64_t r) {
    return ((s * Hkv + h) * max_parts + p) * max_rows + r;
  };

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(max_rows * D), kf(BS * D), vf(D), scores(max_rows * BS);
    for (int64_t t = begin; t < end; ++t) {
      const auto [s, h, p] = tasks[t];
      const int64_t n_q = qlens[s], rows = n_q * G, len = lens[s], ctx = len - n_q;
      for (int64_t j = 0; j < n_q; ++j)
        for (int64_t g = 0; g < G; ++g) {
          const Q* src = qp + (starts[s] + j) * q_row + (h * G + g) * q_head;
          float* dst = qf.data() + (j * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]) * fscale;
        }
      float* m = part_max.data() + slot(s, h, p, 0);
      float* l = part_sum.data() + slot(s, h, p, 0);
      float* acc = part_acc.data() + slot(s, h, p, 0) * D;
      int64_t first = p * part_tokens;
      const int64_t last = std::min(len, first + part_tokens);
      if (window > 0) first = std::max(first, (ctx + 1 - window) / BS * BS);  // keys no query's window holds
      for (int64_t b0 = first; b0 < last; b0 += BS - (b0 % BS)) {
        const int64_t block = tables[s * max_blocks + b0 / BS];
        const int64_t n = std::min(last, b0 - b0 % BS + BS) - b0;  // tokens of this block in range
        const KV* kb = kp + ((block * BS + b0 % BS) * Hkv + h) * D;
        const KV* vb = vp + ((block * BS + b0 % BS) * Hkv + h) * D;
        for (int64_t i = 0; i < n; ++i) {
          const KV* krow = kb + i * Hkv * D;
          float* kd = kf.data() + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) kd[d] = widen(krow[d]);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = ctx + r / G;  // query j sits at position ctx + j and sees keys <= it
          const int64_t oldest = window > 0 ? visible - window + 1 : 0;  // and, in a window, none before this
          const float* qr = qf.data() + r * D;
          float* sr = scores.data() + r * BS;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t i = 0; i < n; ++i) {
            float dot = 0.f;
            const float* kd = kf.data() + i * D;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qr[d] * kd[d];
            if (cap > 0.f) dot = cap * std::tanh(dot / cap);  // soft-capped scores (Gemma 2)
            const int64_t key = b0 + i;
            sr[i] = key <= visible && key >= oldest ? dot : -std::numeric_limits<float>::infinity();
            block_max = std::max(block_max, sr[i]);
          }
          if (block_max == -std::numeric_limits<float>::infinity()) {
            for (int64_t i = 0; i < n; ++i) sr[i] = 0.f;
            continue;
          }
          const float new_max = std::max(m[r], block_max);
          const float alpha = std::exp(m[r] - new_max);  // exp(-inf) = 0 on the first block
          m[r] = new_max;
          float sum = 0.f;
          for (int64_t i = 0; i < n; ++i) {
            sr[i] = std::exp(sr[i] - new_max);
            sum += sr[i];
          }
          l[r] = l[r] * alpha + sum;
          if (alpha != 1.f) {
            float* a = acc + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
          }
        }
        for (int64_t i = 0; i < n; ++i) {
          const KV* vrow = vb + i * Hkv * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) vf[d] = widen(vrow[d]);
          for (int64_t r = 0; r < rows; ++r) {
            const float w = scores[r * BS + i];
            if (w == 0.f) continue;
            float* a = acc + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * vf[d];
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
