// The CPU capability of the process (cpu_capability.h) and the op that reports it,
// torch.ops.posenc.cpu_capability().
#include "ops/common/cpu/cpu_capability.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

namespace posenc {
namespace ops {
namespace cpu {
namespace {

// The best level this CPU runs among those built.
CpuCapability hardware_capability() {
#if defined(POSENC_CPU_AVX2) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  // The AVX2 build is compiled with -mavx2 -mfma -mf16c.
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
      !__builtin_cpu_supports("f16c")) {
    return CpuCapability::kDefault;
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return CpuCapability::kAvx512;
  }
  return CpuCapability::kAvx2;
#else
  return CpuCapability::kDefault;
#endif
}

// The cap that POSENC_CPU_CAPABILITY asks for; kAvx512 (no cap) when unset or empty.
CpuCapability requested_capability() {
  const char* env = std::getenv("POSENC_CPU_CAPABILITY");
  if (env == nullptr || *env == '\0') return CpuCapability::kAvx512;
  std::string value(env);
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (CpuCapability c : {CpuCapability::kDefault, CpuCapability::kAvx2, CpuCapability::kAvx512}) {
    if (value == cpu_capability_name(c)) return c;
  }
  TORCH_CHECK_VALUE(false, "posenc: expected the environment variable POSENC_CPU_CAPABILITY to be "
                    "one of default, avx2, avx512 (or unset), got '", env, "'");
  return CpuCapability::kAvx512;  // not reached
}

std::string cpu_capability_op() { return cpu_capability_name(cpu_capability()); }

}  // namespace

CpuCapability cpu_capability() {
  // A cap above what the CPU supports gives what it supports (as ATEN_CPU_CAPABILITY does).
  static const CpuCapability chosen = std::min(hardware_capability(), requested_capability());
  return chosen;
}

void unsupported_kernel_dtype(const char* kernel, c10::ScalarType dtype) {
  TORCH_CHECK_TYPE(false, "posenc: ", kernel, " expected float16, bfloat16, float32 or float64, got ",
                   dtype);
  std::abort();  // not reached
}

const char* cpu_capability_name(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::kAvx2: return "avx2";
    case CpuCapability::kAvx512: return "avx512";
    case CpuCapability::kDefault: break;
  }
  return "default";
}

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // The vector ISA level the CPU kernels run with in this process: "default", "avx2" or
  // "avx512" (cpu_capability.h). No tensor: one kernel for every backend.
  m.def("cpu_capability() -> str", &cpu_capability_op);
}

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
