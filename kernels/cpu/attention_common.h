// What every ISA path of the paged attention kernel shares: the call's shape and one unit of work.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace conveyor {

struct Params {
  int64_t Hkv, G, D, BS, window;
  float scale, cap;     // cap > 0: scores s -> cap * tanh(s / cap) before the mask (Gemma 2)
  int64_t q_row, q_head;  // q's strides, in elements
  int64_t call;           // this call's number: what a thread prepared for it stays valid through the call
};

// Tokens j = 0..n-1 of one sequence (at positions pos0 + j) against one softmax unit of one KV head: nb
// consecutive cache blocks (positions b0 .. b0 + nb * BS - 1) inside one cell of a fixed grid of absolute
// positions (unit_tokens, paged_attention.cpp), so a row meets the same units whatever the chunking, the
// cache or the rest of the step. Every row (token j, query head g of the group) keeps an unnormalised
// online-softmax state: m[j * G + g], l[...], acc[(j * G + g) * D ...]. Each row's arithmetic depends only
// on that row, the unit's keys it sees and their positions, never on n, nb beyond those keys, or the other
// rows: a token gets the same bits as a decode row or inside a prompt chunk. Keys the row cannot see
// (after it; before its window) weigh exactly 0 and are never read for V; blocks it cannot see at all are
// not read.
struct Span {
  const void* q;  // token 0's first query head of this KV head; + j * q_row + g * q_head
  int64_t n, pos0;
  float* m;
  float* l;
  float* acc;
  const void* const* k;  // block i's key 0 of this KV head, i < nb; key x at + x * Hkv * D
  const void* const* v;
  int64_t nb;
  int64_t b0;  // position of block 0's key 0
  const Span* next = nullptr;  // the span this thread runs next, if known: a path may start on it early
};

using BlockFn = void (*)(const Params&, const Span&);

// The keys of positions [b0, b0 + len) that a token at pos sees, as [lo, hi] offsets; lo > hi: none.
inline void visible_keys(const Params& p, int64_t pos, int64_t b0, int64_t len, int64_t* lo, int64_t* hi) {
  const int64_t oldest = p.window > 0 ? pos - p.window + 1 : 0;
  *lo = oldest > b0 ? oldest - b0 : 0;
  *hi = pos - b0 < len - 1 ? pos - b0 : len - 1;
}

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace conveyor
