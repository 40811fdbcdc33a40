// MXCSR for running TDPBF16PS's arithmetic on AVX-512 FMAs: the tiles round to nearest even with input
// denormals read as zero and output denormals flushed (bench/tdpbf16ps_probe.cpp), whatever MXCSR says, so
// an FMA twin of a tile's sums runs under DAZ and FTZ and switches back before any other arithmetic.
#pragma once
#include <immintrin.h>

namespace conveyor {

constexpr unsigned kDazFtz = 0x8040;    // MXCSR: denormals are zero, flush to zero
constexpr unsigned kRounding = 0x6000;  // MXCSR: the rounding mode (0: to nearest even, as the tiles round)

// csr with the tiles' rounding, DAZ and FTZ; its exception masks kept.
inline unsigned tile_csr(unsigned csr) { return (csr & ~kRounding) | kDazFtz; }

// The compiler does not know that MXCSR changes arithmetic: the memory clobbers keep loads and stores (and
// so the arithmetic between them) on their side of the switch; a value held in registers across it must be
// pinned (quant_gemm_rows.cpp) or go through memory.
inline void switch_csr(unsigned csr) {
  asm volatile("" ::: "memory");
  _mm_setcsr(csr);
  asm volatile("" ::: "memory");
}

}  // namespace conveyor
