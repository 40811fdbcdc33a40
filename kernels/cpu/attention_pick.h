// Which path runs a call (paged_attention.cpp includes it inside its anonymous namespace): what the CPU
// reports (isa "auto") or the path a test or bench names.

bool cpu_has(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "portable") return true;
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx512") return v4;
  if (isa == "avx512_bf16") return v4 && __builtin_cpu_supports("avx512bf16");
  return isa == "amx" && v4 && conveyor::amx_usable();  // amx_usable.h
}

std::vector<std::string> isas() {
  std::vector<std::string> out;
  for (const char* isa : {"portable", "avx2", "avx512", "avx512_bf16", "amx"})
    if (cpu_has(isa)) out.emplace_back(isa);
  return out;
}

// amx_ok: the block size suits the tiles (under 16 and dividing it, or a multiple of 16 up to 64).
template <typename Q, typename KV>
BlockFn pick(std::string isa, bool bf16_ok, bool amx_ok) {
  // amx where the tiles run: prompts 1.5-1.7x, decodes 0.98-1.00x, served 1.01-1.27x (docs/kernels.md, version 9)
  if (isa == "auto") isa = bf16_ok && amx_ok && cpu_has("amx") ? "amx"
                         : bf16_ok && cpu_has("avx512_bf16") ? "avx512_bf16" : cpu_has("avx512") ? "avx512"
                         : cpu_has("avx2") ? "avx2" : "portable";
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run the ", isa, " attention path");
  if (isa == "avx512_bf16" || isa == "amx") {
    TORCH_CHECK(bf16_ok, isa, " needs bfloat16 q and cache, head dim a multiple of 32, at most 64 heads a group");
    TORCH_CHECK(isa != "amx" || amx_ok, "amx needs a block size under 16 dividing it, or a multiple of 16 up to 64");
    return isa == "amx" ? &bf16::block<true> : &bf16::block<false>;
  }
  if (isa == "avx512") return &avx512::block<Q, KV>;
  if (isa == "avx2") return &avx2::block<Q, KV>;
  return &portable::block<Q, KV>;
}
