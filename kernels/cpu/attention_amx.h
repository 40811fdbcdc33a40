// The AMX path's scores (isa "amx"): the AVX-512 BF16 path with every row's q.k taken by TDPBF16PS, for
// decode rows (block_keys) and prompt rows (block_rows) alike, so the two still give a row the same bits.
// A K block is the A tile as the cache holds it (keys as tile rows, no transposition); the queries are the
// B tile (pairs of dims as tile rows, one query row per column, transposed once per span and head); C holds
// [key][query row]. A C element is one chain over the head dim's pairs, whatever the other rows and
// columns hold (the hardware's own order: not the vdpbf16ps lane tree, so the path has its own bits). The
// softmax is the AVX-512 BF16 path's; the V update too at block sizes under 16, else TDPBF16PS's
// (attention_amx_pv.h). Included by attention_bf16.h inside namespace bf16.

// 16 rows of 16 dwords transposed in place (r[i] lane c -> r[c] lane i): moves bits only.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // r[4a + e], 128-bit lane l: rows 4a..4a+3 at column 4l + e
    r[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    r[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    r[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    r[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i xl = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), xh = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
    const __m512i yl = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
    const __m512i yh = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(xl, yl, 0x88), t[4 + e] = _mm512_shuffle_i32x4(xl, yl, 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(xh, yh, 0x88), t[12 + e] = _mm512_shuffle_i32x4(xh, yh, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C in tiles 0-3, K (A) in tiles 4 and 7, queries (B) in tiles 5 and 6; A and C with a block's keys as rows
// (at most 16).
// Once per thread and call: nothing else runs on a thread inside a call.
inline void amx_configure(int64_t key_rows, int64_t call) {
  thread_local int64_t done = -1;
  if (done == call) return;
  done = call;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = t == 5 || t == 6 ? 16 : static_cast<uint8_t>(key_rows), cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC sees only the first 8 bytes read (quant_gemm.cpp)
  _tile_loadconfig(&cfg);
}

// n query rows (row r at q + r * step, n <= 16) as C B tiles, D = 32 * C: tile c's row x holds every row's
// dims 32c + 2x, 32c + 2x + 1 (row r in column r); rows past n are 0.
template <int C>
inline void amx_queries(const bf* q, int64_t step, int64_t n, __m512i* qb) {
  for (int c = 0; c < C; ++c) {
    __m512i r[16];
    for (int64_t j = 0; j < 16; ++j) r[j] = j < n ? _mm512_loadu_si512(q + j * step + 32 * c) : _mm512_setzero_si512();
    transpose16(r);
    for (int x = 0; x < 16; ++x) qb[16 * c + x] = r[x];
  }
}

// The dot products of a block's keys (key i at k + i * stride) with the 16 query columns of qb, into
// out[i * 16 + column]: min(BS, 16) keys a tile, tiles of the head dim in order into one C tile.
template <int C>
inline void amx_dots(const conveyor::Params& p, const bf* k, const __m512i* qb, float* out) {
  const int64_t stride = p.Hkv * p.D, rows = p.BS < 16 ? p.BS : 16;
  for (int64_t i0 = 0; i0 < p.BS; i0 += rows) {
    _tile_zero(0);
    for (int c = 0; c < C; ++c) {
      _tile_loadd(4, k + i0 * stride + 32 * c, stride * 2);
      _tile_loadd(5, qb + 16 * c, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, out + i0 * 16, 64);
  }
}

// Chunk u of a decode token's unit (keys k, stride in elements) into C tile T, its K through tile A (4 and 7
// in turn, so one chunk's load need not wait for the last one's TDPs); B in tiles 5 and 6 where D <= 64,
// else reloaded from qb. The same TDPs in the same order as amx_dots: the same bits.
#define CONVEYOR_AMX_CHUNK(T, A)                                                    \
  if (u_n > T) {                                                                   \
    const bf* k = keys[T];                                                         \
    _tile_zero(T);                                                                 \
    for (int c = 0; c < C; ++c) {                                                  \
      _tile_loadd(A, k + 32 * c, stride * 2);                                      \
      if (C <= 2 && c == 0) _tile_dpbf16ps(T, A, 5);                               \
      else if (C <= 2) _tile_dpbf16ps(T, A, 6);                                    \
      else { _tile_loadd(5, qb + 16 * c, 64); _tile_dpbf16ps(T, A, 5); }           \
    }                                                                              \
  }

// Up to 4 chunks of keys (chunk u's key 0 at keys[u]) against the query tiles qb, into C tiles 0..u_n-1.
template <int C>
inline void amx_chunks(const conveyor::Params& p, const bf* const* keys, int64_t u_n, const __m512i* qb) {
  const int64_t stride = p.Hkv * p.D;
  CONVEYOR_AMX_CHUNK(0, 4)
  CONVEYOR_AMX_CHUNK(1, 7)
  CONVEYOR_AMX_CHUNK(2, 4)
  CONVEYOR_AMX_CHUNK(3, 7)
}
#undef CONVEYOR_AMX_CHUNK

// C tiles 0..u_n-1 into out[u * 256 + key * 16 + column].
inline void amx_store(int64_t u_n, float* out) {
  _tile_stored(0, out, 64);
  if (u_n > 1) _tile_stored(1, out + 256, 64);
  if (u_n > 2) _tile_stored(2, out + 512, 64);
  if (u_n > 3) _tile_stored(3, out + 768, 64);
}

// Key 0 of chunks x..x+u_n-1 of a span's unit (chunks of min(BS, 16) keys, in block order).
inline void amx_keys(const conveyor::Params& p, const conveyor::Span& s, int64_t x, int64_t u_n, const bf** keys) {
  const int64_t rows = p.BS < 16 ? p.BS : 16, per = p.BS / rows;
  for (int64_t u = 0; u < u_n; ++u)
    keys[u] = static_cast<const bf*>(s.k[(x + u) / per]) + (x + u) % per * rows * p.Hkv * p.D;
}

// Spans' C tiles a burst of TDPs scores ahead (at least paged_attention.cpp's kRing - 1). The tiles cost
// ~230 ns each time they start after a pause (a microbenchmark on this Xeon: 2 TDPs every ~1.4 us of FMAs
// slow the FMAs 15-20%, 24 TDPs a burst barely more), so a decode token's units are scored a few at a time.
constexpr int kAhead = 3;

// A thread's query tiles (a token's, 64 heads at most; kept for the token's next units), and the C tiles
// of the spans scored ahead (token q, its first chunk's keys k, in this call), [chunk][key][query head].
struct AmxState {
  __m512i tiles[4 * 8 * 16];
  const bf* tiles_of = nullptr;
  int64_t tiles_call = -1;
  alignas(64) float c[kAhead][4 * 256];
  const bf* c_q[kAhead] = {};
  const bf* c_k[kAhead] = {};
  int64_t c_call[kAhead] = {-1, -1, -1};
};

inline AmxState& amx_state() {
  thread_local AmxState st;
  return st;
}

// The C tiles scored ahead for token q's chunks from keys k, or nullptr.
inline const float* amx_found(const AmxState& st, const bf* q, const bf* k, int64_t call) {
  for (int i = 0; i < kAhead; ++i)
    if (st.c_q[i] == q && st.c_k[i] == k && st.c_call[i] == call) return st.c[i];
  return nullptr;
}

// Scores token 0 of span s and of the spans after it (up to kAhead) into the state's slots, where one pass
// takes them (G <= 16; at most 4 chunks; decode-sized spans): the loads and TDPs their own calls would
// issue, in the same order, so the same bits.
template <int C>
inline void amx_ahead(const conveyor::Params& p, const conveyor::Span* s, int64_t rows_as_lanes) {
  AmxState& st = amx_state();
  for (int i = 0; i < kAhead && s && s->n < rows_as_lanes && p.G <= 16; ++i, s = s->next) {
    int64_t lo, hi;
    conveyor::visible_keys(p, s->pos0, s->b0, s->nb * p.BS, &lo, &hi);
    const int64_t per = p.BS < 16 ? 1 : p.BS / 16, x = lo / p.BS * per, u_n = (hi / p.BS + 1) * per - x;
    if (lo > hi || u_n > 4) return;
    const bf* keys[4];
    amx_keys(p, *s, x, u_n, keys);
    const bf* q = static_cast<const bf*>(s->q);
    amx_queries<C>(q, p.q_head, p.G, st.tiles);
    st.tiles_of = q, st.tiles_call = p.call;
    if (C <= 2) _tile_loadd(5, st.tiles, 64);
    if (C == 2) _tile_loadd(6, st.tiles + 16, 64);
    amx_chunks<C>(p, keys, u_n, st.tiles);
    amx_store(u_n, st.c[i]);
    st.c_q[i] = q, st.c_k[i] = keys[0], st.c_call[i] = p.call;
  }
}
