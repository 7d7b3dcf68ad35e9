// bf16 autocast (see precision.h).
#include "models/precision.h"

#include <cpuid.h>

#include <cstdlib>
#include <string>

#include <ATen/autocast_mode.h>

namespace caravan {

bool cpuHasBf16Instructions() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 5)) != 0)
    return true;  // AVX512_BF16
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && (d & (1u << 22)) != 0)
    return true;  // AMX-BF16
  return false;
}

bool cpuRunsBf16() {
  const char* emulate = std::getenv(kEmulateBf16Env);
  return cpuHasBf16Instructions() || (emulate != nullptr && std::string(emulate) == "1");
}

Bf16Autocast::Bf16Autocast()
    : enabled_(at::autocast::is_autocast_enabled(at::kCPU)),
      cache_(at::autocast::is_autocast_cache_enabled()),
      dtype_(static_cast<int>(at::autocast::get_autocast_dtype(at::kCPU))) {
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::set_autocast_cache_enabled(false);
}

Bf16Autocast::~Bf16Autocast() {
  at::autocast::set_autocast_enabled(at::kCPU, enabled_);
  at::autocast::set_autocast_dtype(at::kCPU, static_cast<at::ScalarType>(dtype_));
  at::autocast::set_autocast_cache_enabled(cache_);
}

}  // namespace caravan
