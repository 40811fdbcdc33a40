// Paged attention on the CPU for every query row of a step: decode tokens, speculative verification,
// and prompt chunks, reading K/V blocks where they lie in the cache (no gather into a buffer).
//
// A row (one token, one query head) walks its context in a fixed order, whatever else is in the step:
// the context is cut into partitions of part_tokens positions from position 0, and each partition into
// softmax units of 64 positions (unit_tokens); each partition's units go through an online softmax from a
// fresh state into an unnormalised partial (max, sum, accumulator); the partials merge in partition
// order. The unit arithmetic (attention_generic.h, attention_bf16.h) depends only on the row, the unit's
// keys and the row's position, so a token's output has the same bits whether it is decoded, inside a
// prompt chunk, or attends a prefix another request cached.
// Work: a sequence with few query tokens gets one task per partition (a long context keeps both cores
// busy; cut per KV head where partitions are few; the last task of the sequence to finish merges); a
// prompt chunk gets one task per 16 tokens covering all its partitions,
// merged in the task. Blocks a task's tokens cannot see (causal, sliding window) are never read. Tasks
// are handed out largest first from a shared counter.
// window > 0: a query at position p sees keys p - window + 1 .. p; softcap > 0: scores s become
// softcap * tanh(s / softcap) before the mask (Gemma 2).
// Paths, picked at run time from what the CPU reports (isa "auto") or named (tests, benches): portable,
// avx2 and avx512 (attention_generic.h compiled for each level) and avx512_bf16 (bfloat16 q and cache,
// head dim a multiple of 32: vdpbf16ps on the cache's rows).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "amx_usable.h"

#include "attention_common.h"
#include "tile_csr.h"

#pragma GCC push_options
#pragma GCC target("arch=x86-64")
namespace portable {
#include "attention_generic.h"
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
namespace avx2 {
#include "attention_generic.h"
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
namespace avx512 {
#include "attention_generic.h"
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")  // beside -march
#include "attention_bf16.h"
#pragma GCC pop_options

namespace {

using conveyor::BlockFn;
using conveyor::Params;
using conveyor::Span;

constexpr int64_t kChunkTokens = 16;  // tokens per task of a prompt chunk; fewer: one task per partition
// Positions per softmax unit (fewer where the partition or block size says so, unit_tokens): one online-
// softmax update per row per unit instead of per block, on every path.
constexpr int64_t kUnitTokens = 64;
// Fewer partition tasks than this per thread: each is cut per KV head (plan).
constexpr int64_t kSplitHeadsBelow = 4;
constexpr int64_t kRing = 4;  // spans attend sets up before it runs the first (the amx path scores ahead)

#include "attention_pick.h"

struct Task {
  int64_t seq, t0, t1, p0, p1;  // tokens [t0, t1) of the sequence over partitions [p0, p1)
  int64_t h0, h1;               // KV heads [h0, h1)
  int64_t slot;                 // its sequence's partials in the shared buffer; -1: its own, merged in the task
  int64_t cost;
};

struct Call {
  Params p;
  BlockFn fn;
  const int32_t *tables, *starts, *qlens, *lens;
  int64_t max_blocks, part_tokens, o_row, o_head, H, esize, qsize;  // esize, qsize: cache's, q's bytes
  const char* q;
  const char* k;
  const char* v;
};

#include "attention_partials.h"

// The partitions of a sequence that tokens at positions [first, last] see.
void part_range(const Call& c, int64_t first, int64_t last, int64_t* p0, int64_t* p1) {
  const int64_t oldest = c.p.window > 0 ? std::max<int64_t>(0, first - c.p.window + 1) : 0;
  *p0 = oldest / c.part_tokens;
  *p1 = last / c.part_tokens + 1;
}

// The cell of the softmax grid: kUnitTokens positions (at least one block), nested in the partitions.
int64_t unit_tokens(int64_t BS, int64_t part_tokens) {
  int64_t blocks = std::max<int64_t>(1, kUnitTokens / BS);
  while (part_tokens % (blocks * BS) != 0) --blocks;
  return blocks * BS;
}

// A task of some KV heads [h0, h1): fetches their lines of the blocks of positions [b0, b_end), one unit's
// worth. (Tasks of all heads keep attend's own loop: moved out, it ran 64 x 2,048 decodes 20% slower.)
void prefetch_heads(const Call& c, int64_t seq, int64_t b0, int64_t b_end, int64_t h0, int64_t h1) {
  const int64_t BS = c.p.BS, kv_row = c.p.Hkv * c.p.D * c.esize, head = c.p.D * c.esize;
  const int64_t nb = std::min<int64_t>(unit_tokens(BS, c.part_tokens) / BS, (b_end - b0 + BS - 1) / BS);
  const int32_t* blocks = c.tables + seq * c.max_blocks + b0 / BS;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = blocks[b] * BS * kv_row + h0 * head; r < (blocks[b] + 1) * BS * kv_row; r += kv_row)
      for (int64_t x = 0; x < (h1 - h0) * head; x += 64) {
        __builtin_prefetch(c.k + r + x);
        __builtin_prefetch(c.v + r + x);
      }
}

void attend(const Call& c, const Task& t, const Partials& out) {
  const Params& p = c.p;
  const int64_t ctx = c.lens[t.seq] - c.qlens[t.seq], first = ctx + t.t0, last = ctx + t.t1 - 1;
  const int64_t oldest = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) : 0;
  const int64_t kv_row = p.Hkv * p.D * c.esize, q_tok = p.q_row * c.qsize, q_h = p.G * p.q_head * c.qsize;
  const int64_t unit = unit_tokens(p.BS, c.part_tokens);
  const void* kp[kRing][kUnitTokens];  // the unit's blocks, this KV head (unit / BS <= kUnitTokens); span n's
  const void* vp[kRing][kUnitTokens];  // in [n % kRing]
  Span s[kRing];
  int64_t n = 0;  // span n runs once span n + kRing - 1 is set up: the path can see its next ones
  const int64_t first_b0 = std::max(t.p0 * c.part_tokens, oldest / p.BS * p.BS);
  for (int64_t part = t.p0; part < t.p1; ++part) {
    const int64_t b_end = std::min((part + 1) * c.part_tokens, last + 1);
    for (int64_t b0 = std::max(part * c.part_tokens, oldest / p.BS * p.BS); b0 < b_end;) {
      const int64_t u_end = std::min((b0 / unit + 1) * unit, b_end), nb = (u_end - b0 + p.BS - 1) / p.BS;
      const int32_t* blocks = c.tables + t.seq * c.max_blocks + b0 / p.BS;
      // The next unit's blocks lie anywhere: fetch them while this one is worked on; on a task's first
      // unit, its own blocks too (from memory, a served step's case, 1.1-1.2x; per-head tasks: 1.00x). Not
      // for a prompt chunk's task (slot < 0): the tasks of its neighbouring tokens have just read the same
      // blocks, and the prefetches alone took 4% of a 2,048-token step's prompt attention (session 28).
      const bool fetch = t.slot >= 0;
      if (fetch && t.h1 - t.h0 < p.Hkv) {
        if (b0 + nb * p.BS < b_end) prefetch_heads(c, t.seq, b0 + nb * p.BS, b_end, t.h0, t.h1);
      } else if (fetch) {
        const int64_t more = std::min<int64_t>(unit / p.BS, (b_end - b0 - nb * p.BS + p.BS - 1) / p.BS);
        for (int64_t b = b0 == first_b0 ? 0 : nb; b < nb + more; ++b)
          for (int64_t x = 0; x < p.BS * kv_row; x += 64) {
            __builtin_prefetch(c.k + blocks[b] * p.BS * kv_row + x);
            __builtin_prefetch(c.v + blocks[b] * p.BS * kv_row + x);
          }
      }
      for (int64_t h = t.h0; h < t.h1; ++h, ++n) {
        const int64_t r = out.at(h, part), i = n % kRing;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t kv = blocks[b] * p.BS * kv_row + h * p.D * c.esize;
          kp[i][b] = c.k + kv, vp[i][b] = c.v + kv;
        }
        s[i] = Span{c.q + (c.starts[t.seq] + t.t0) * q_tok + h * q_h, t.t1 - t.t0, first,
                    out.m + r, out.l + r, out.acc + r * p.D, kp[i], vp[i], nb, b0};
        if (n > 0) s[(n - 1) % kRing].next = &s[i];
        if (n >= kRing - 1) c.fn(p, s[(n + 1) % kRing]);
      }
      b0 += nb * p.BS;
    }
  }
  for (int64_t x = std::max<int64_t>(0, n - kRing + 1); x < n; ++x) c.fn(p, s[x % kRing]);
}

// The call's tasks, largest first; base[s]: where sequence s's partials start in the shared buffer (-1:
// a prompt chunk, merged in its tasks); left[s]: its partition tasks. Where partitions are few (one
// stream, short contexts), each partition task is cut per KV head: heads have their own rows and partials
// (and cache lines, where D * element size is a multiple of 64 bytes), so no row's bits move.
// -> the shared buffer's size, in floats.
int64_t plan(const Call& c, int64_t num_seqs, std::vector<Task>& tasks, std::vector<int64_t>& base,
             std::vector<int64_t>& left) {
  const Params& p = c.p;
  int64_t floats = 0, parts = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    int64_t p0, p1;
    part_range(c, c.lens[s] - c.qlens[s], c.lens[s] - 1, &p0, &p1);
    if (c.qlens[s] <= kChunkTokens) parts += p1 - p0;
  }
  const int64_t split = parts < kSplitHeadsBelow * at::get_num_threads() ? p.Hkv : 1;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n_q = c.qlens[s], ctx = c.lens[s] - n_q;
    if (n_q > kChunkTokens) {
      for (int64_t t0 = 0; t0 < n_q; t0 += kChunkTokens) {
        Task t{s, t0, std::min(n_q, t0 + kChunkTokens), 0, 0, 0, p.Hkv, -1, 0};
        part_range(c, ctx + t.t0, ctx + t.t1 - 1, &t.p0, &t.p1);
        t.cost = (t.t1 - t.t0) * (ctx + t.t1 - t.p0 * c.part_tokens);
        tasks.push_back(t);
      }
      continue;
    }
    int64_t p0, p1;
    part_range(c, ctx, c.lens[s] - 1, &p0, &p1);
    base[s] = floats, left[s] = (p1 - p0) * split;
    for (int64_t part = p0; part < p1; ++part) {
      const int64_t span = std::min<int64_t>(c.lens[s], (part + 1) * c.part_tokens) - part * c.part_tokens;
      for (int64_t h = 0; h < p.Hkv; h += p.Hkv / split)
        tasks.push_back({s, 0, n_q, part, part + 1, h, h + p.Hkv / split, floats, n_q * span * p.Hkv / split});
    }
    floats += p.Hkv * (p1 - p0) * n_q * p.G * (p.D + 2);
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return floats;
}

// One task (a partition task: into the shared partials; the last of its sequence to finish merges them,
// so no second parallel pass is needed).
template <typename Q>
void work(const Call& c, const Task& t, const Partials& shared, std::atomic<int64_t>& left, Q* op) {
  const Params& p = c.p;
  thread_local std::vector<float> own;
  if (t.slot >= 0) {
    clear_part(shared, p, t.p0, t.h0, t.h1);
    attend(c, t, shared);
    if (left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (static_cast<int64_t>(own.size()) < p.D) own.resize(p.D);
    return merge(c, shared, t.seq, 0, c.qlens[t.seq], op, own.data());
  }
  const int64_t rows = (t.t1 - t.t0) * p.G, need = p.Hkv * (t.p1 - t.p0) * rows * (p.D + 2);
  if (static_cast<int64_t>(own.size()) < need + p.D) own.resize(need + p.D);
  const Partials part = carve(own.data(), p, t.p0, t.p1 - t.p0, rows, true);
  attend(c, t, part);
  merge(c, part, t.seq, t.t0, t.t1, op, own.data() + need);
}

template <typename Q>
void run(const Call& c, Q* op, int64_t num_seqs) {
  const Params& p = c.p;
  std::vector<Task> tasks;
  std::vector<int64_t> base(num_seqs, -1), counts(num_seqs, 0);
  const int64_t floats = plan(c, num_seqs, tasks, base, counts);
  std::vector<float>& buf = shared_buffer();
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(floats);
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s) left[s].store(counts[s], std::memory_order_relaxed);
  auto shared_view = [&](int64_t s) {
    if (base[s] < 0) return Partials{};
    int64_t p0, p1;
    part_range(c, c.lens[s] - c.qlens[s], c.lens[s] - 1, &p0, &p1);
    return carve(buf.data() + base[s], p, p0, p1 - p0, c.qlens[s] * p.G, false);
  };
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_tasks), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n_tasks; i = next++)
      work(c, tasks[i], shared_view(tasks[i].seq), left[tasks[i].seq], op);
  });
}

// Writes the attention of the given sequences' query rows into out's same rows; other rows untouched.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_start, const at::Tensor& q_len,
                     const at::Tensor& seq_len, double scale, int64_t part_tokens, int64_t window, double softcap,
                     c10::string_view isa) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "q/out shapes");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out rows must have contiguous head dims");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(), "caches");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "heads");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables int32");
  for (const auto* t : {&q_start, &q_len, &seq_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->size(0) == block_tables.size(0), "seqs");
  TORCH_CHECK(part_tokens > 0 && part_tokens % k_cache.size(1) == 0, "part_tokens: a multiple of the block size");
  const int64_t Hkv = k_cache.size(2), G = q.size(1) / Hkv, D = q.size(2);
  static std::atomic<int64_t> calls{0};
  Call c{};
  c.p = Params{Hkv, G, D, k_cache.size(1), window, static_cast<float>(scale), static_cast<float>(softcap),
               q.stride(0), q.stride(1), ++calls};
  c.tables = block_tables.data_ptr<int32_t>();
  c.starts = q_start.data_ptr<int32_t>(), c.qlens = q_len.data_ptr<int32_t>(), c.lens = seq_len.data_ptr<int32_t>();
  c.max_blocks = block_tables.size(1), c.part_tokens = part_tokens;
  c.o_row = out.stride(0), c.o_head = out.stride(1), c.H = q.size(1), c.esize = k_cache.element_size();
  c.qsize = q.element_size();
  c.q = static_cast<const char*>(q.data_ptr()), c.k = static_cast<const char*>(k_cache.data_ptr());
  c.v = static_cast<const char*>(v_cache.data_ptr());
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  const bool bf16_ok = qt == at::kBFloat16 && ct == at::kBFloat16 && D % 32 == 0 && D <= 256 && G <= 64;
  const int64_t BS = k_cache.size(1);
  const bool amx_ok = BS <= 64 && (BS % 16 == 0 || 16 % BS == 0);
  const std::string name(isa.data(), isa.size());
  const int64_t n = q_start.size(0);
  if (qt == at::kFloat && ct == at::kFloat)
    c.fn = pick<float, float>(name, false, false), run(c, out.data_ptr<float>(), n);
  else if (qt == at::kFloat && ct == at::kBFloat16)
    c.fn = pick<float, c10::BFloat16>(name, false, false), run(c, out.data_ptr<float>(), n);
  else if (qt == at::kBFloat16 && ct == at::kFloat)
    c.fn = pick<c10::BFloat16, float>(name, false, false), run(c, out.data_ptr<c10::BFloat16>(), n);
  else if (qt == at::kBFloat16 && ct == at::kBFloat16)
    c.fn = pick<c10::BFloat16, c10::BFloat16>(name, bf16_ok, amx_ok), run(c, out.data_ptr<c10::BFloat16>(), n);
  else
    TORCH_CHECK(false, "unsupported dtypes: q ", qt, ", cache ", ct);
}

}  // namespace

TORCH_LIBRARY(conveyor_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor q_start, Tensor q_len, Tensor seq_len, float scale, int part_tokens, int window, float softcap, "
        "str isa='auto') -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def("attention_isas() -> str[]", &isas);
}
