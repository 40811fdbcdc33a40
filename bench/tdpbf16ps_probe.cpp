// What TDPBF16PS computes, bit for bit: one AMX C tile (16 x 16 float32, four 32-k tiles of A and B)
// against candidate emulations, on random and adversarial bfloat16 inputs (no inf or NaN inputs).
//
//     g++ -O2 -march=native bench/tdpbf16ps_probe.cpp -o /tmp/tdpbf16ps_probe && /tmp/tdpbf16ps_probe
//
// Prints, per input kind, how many of the 51,200 outputs each emulation gets wrong. On the 2-core AMX Xeon
// (2026-11-26) only "two chains" was exact, on every kind: per C element and per instruction (32 k), one
// float32 FMA chain from zero over the even k and one over the odd k, in k order, then C += even + odd, all
// rounding to nearest even under DAZ and FTZ (the SDM's pseudo-code says the same). Without DAZ/FTZ it
// fails only on denormal inputs; vdpbf16ps (one chain, each pair's odd product first) and one FMA chain in
// k order fail on about half of all outputs. kernels/cpu/quant_gemm.cpp's rows path is "two chains".
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kPairs = 64;  // k pairs: four 32-k instructions
uint16_t A[16][2 * kPairs], B[kPairs][32];
float C[16][16];

float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

__attribute__((target("amx-tile,amx-bf16"))) void amx() {
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  for (int t = 0; t < kPairs / 16; ++t) {
    _tile_loadd(1, &A[0][32 * t], sizeof(A[0]));
    _tile_loadd(2, &B[16 * t][0], 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, C, 64);
  _tile_release();
}

float two_chains(int m, int n) {
  float c = 0.f;
  for (int t = 0; t < kPairs / 16; ++t) {
    float even = 0.f, odd = 0.f;
    for (int p = 16 * t; p < 16 * t + 16; ++p) {
      even = std::fma(widen(A[m][2 * p]), widen(B[p][2 * n]), even);
      odd = std::fma(widen(A[m][2 * p + 1]), widen(B[p][2 * n + 1]), odd);
    }
    c = c + (even + odd);
  }
  return c;
}

float one_chain(int m, int n) {
  float c = 0.f;
  for (int p = 0; p < kPairs; ++p) {
    c = std::fma(widen(A[m][2 * p]), widen(B[p][2 * n]), c);
    c = std::fma(widen(A[m][2 * p + 1]), widen(B[p][2 * n + 1]), c);
  }
  return c;
}

__attribute__((target("avx512f,avx512bf16"))) float vdpbf16ps(int m, int n) {
  __m512 c = _mm512_setzero_ps();
  for (int p = 0; p < kPairs; ++p) {
    const uint32_t a = A[m][2 * p] | (static_cast<uint32_t>(A[m][2 * p + 1]) << 16);
    const uint32_t b = B[p][2 * n] | (static_cast<uint32_t>(B[p][2 * n + 1]) << 16);
    c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_set1_epi32(a), (__m512bh)_mm512_set1_epi32(b));
  }
  return _mm512_cvtss_f32(c);
}

uint16_t draw(std::mt19937& g, int kind) {
  std::normal_distribution<float> normal(0.f, 1.f);
  float f = normal(g);
  if (kind == 1) f = std::ldexp(f, static_cast<int>(g() % 41) - 20);  // 2^-20..2^20: cancellations
  if (kind == 2) {                                                   // any finite bit pattern
    uint16_t b = static_cast<uint16_t>(g());
    return ((b >> 7) & 0xFF) == 0xFF ? b & 0x807F : b;
  }
  if (kind == 3) {  // denormals and values near the smallest normal
    if (g() % 3 == 0) return static_cast<uint16_t>((g() % 2 ? 0x8000 : 0) | (g() % 127 + 1));
    f = std::ldexp(f, -60 - static_cast<int>(g() % 10));
  }
  return static_cast<uint16_t>(bits(f) >> 16);
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::puts("no AMX tile permission");
    return 1;
  }
  const char* kinds[] = {"normal", "2^-20..2^20", "any bits", "denormal", "opposite pairs"};
  std::mt19937 g(7);
  for (int kind = 0; kind < 5; ++kind) {
    long wrong[5] = {}, total = 0;
    for (int trial = 0; trial < 200; ++trial) {
      for (auto& row : A)
        for (auto& v : row) v = draw(g, kind == 4 ? 1 : kind);
      for (auto& row : B)
        for (auto& v : row) v = draw(g, kind == 4 ? 1 : kind);
      if (kind == 4)  // each odd product the even one's negative, up to a last bit: large cancellations
        for (int p = 0; p < kPairs; ++p) {
          for (int m = 0; m < 16; ++m) A[m][2 * p + 1] = A[m][2 * p] ^ 0x8000 ^ (g() % 2);
          for (int n = 0; n < 16; ++n) B[p][2 * n + 1] = B[p][2 * n] ^ (g() % 2);
        }
      amx();
      for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
          ++total;
          const unsigned csr = _mm_getcsr();
          _mm_setcsr(csr | 0x8040);  // DAZ | FTZ
          const float daz[] = {two_chains(m, n), one_chain(m, n), vdpbf16ps(m, n)};
          _mm_setcsr(csr);
          const float plain[] = {two_chains(m, n), one_chain(m, n)};
          const float got[] = {daz[0], plain[0], daz[1], plain[1], daz[2]};
          for (int e = 0; e < 5; ++e) wrong[e] += bits(got[e]) != bits(C[m][n]);
        }
    }
    std::printf("%-15s %ld outputs wrong: two chains %ld, two chains without DAZ/FTZ %ld, one chain %ld, "
                "one chain without DAZ/FTZ %ld, vdpbf16ps %ld\n",
                kinds[kind], total, wrong[0], wrong[1], wrong[2], wrong[3], wrong[4]);
  }
}
