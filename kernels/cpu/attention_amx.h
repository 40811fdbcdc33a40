// The AMX path's scores (isa "amx"): the AVX-512 BF16 path with every row's q.k taken by TDPBF16PS, for
// decode rows (block_keys) and prompt rows (block_rows) alike, so the two still give a row the same bits.
// A K block is the A tile as the cache holds it (keys as tile rows, no transposition); the queries are the
// B tile (pairs of dims as tile rows, one query row per column, transposed once per span and head); C holds
// [key][query row]. A C element is one chain over the head dim's pairs, whatever the other rows and
// columns hold (the hardware's own order: not the vdpbf16ps lane tree, so the path has its own bits). The
// softmax and the V update are the AVX-512 BF16 path's. Included by attention_bf16.h inside namespace bf16.

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
    _tile_stored(T, out + T * 256, 64);                                            \
  }

// Up to 4 chunks of keys (chunk u's key 0 at keys[u]) against the query tiles qb, in 4 C tiles at once, into
// out[u * 256 + key * 16 + column].
template <int C>
inline void amx_chunks(const conveyor::Params& p, const bf* const* keys, int64_t u_n, const __m512i* qb, float* out) {
  const int64_t stride = p.Hkv * p.D;
  CONVEYOR_AMX_CHUNK(0, 4)
  CONVEYOR_AMX_CHUNK(1, 7)
  CONVEYOR_AMX_CHUNK(2, 4)
  CONVEYOR_AMX_CHUNK(3, 7)
}
#undef CONVEYOR_AMX_CHUNK

