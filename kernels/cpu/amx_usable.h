// Whether this process may run AMX tiles: the CPU reports them (tile and bfloat16 bits of CPUID leaf 7, with
// AVX-512 BW and BF16 for the code around them) and the kernel granted the tile registers, which Linux 5.16+
// does only once asked (arch_prctl ARCH_REQ_XCOMP_PERM). Asked once per process; asking again is harmless.
// One check for the attention's amx path and the int4 and int8 GEMMs.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace conveyor {

inline bool amx_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512bf16"))
      return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

}  // namespace conveyor
