// Runtime choice of the CPU kernels' vector ISA, as ATen's DispatchStub makes it.
//
// Each vector-ISA translation unit (POSENC_ISA_SOURCES in CMakeLists.txt) is compiled once
// per capability: DEFAULT (the baseline of the target, e.g. x86-64 SSE2) and, on x86-64,
// AVX2 (AVX2 + FMA + F16C). Each build defines CPU_CAPABILITY to its name, so its functions
// sit in an inline namespace of that name and never clash, and registers its entry points
// into the stubs below (POSENC_REGISTER_DISPATCH). A call goes through the stub, which picks
// the build of the capability chosen once per process (cpu_capability()).
//
// The levels: DEFAULT; AVX2; AVX512 = the AVX2 build plus its AVX-512 paths compiled by
// target attribute (dropout's Philox and mask, sinusoidal_table's sweep, qk_norm_rope's
// rows, FP8 quantisation: common/cpu/half_lanes.h has their shared helpers), chosen inside the
// AVX2 kernels when cpu_capability() is AVX512. The chosen level is the
// best the CPU supports, capped by the environment variable POSENC_CPU_CAPABILITY
// (default | avx2 | avx512, read once, like ATen's ATEN_CPU_CAPABILITY), so that one host
// can run every path it supports (tests/python/test_cpu_capability.py).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {
namespace cpu {

enum class CpuCapability : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// The level of this process (chosen on first use; raises ValueError for an unknown
// POSENC_CPU_CAPABILITY).
CpuCapability cpu_capability();

// "default", "avx2" or "avx512": the values of POSENC_CPU_CAPABILITY and of the op
// torch.ops.posenc.cpu_capability().
const char* cpu_capability_name(CpuCapability capability);

// A kernel entry point with one implementation per capability built. FnPtr is a plain
// function pointer type; Name is a tag type that makes each stub a distinct class.
template <typename FnPtr, typename Name>
struct DispatchStub {
  using Fn = FnPtr;
  // Defined by the builds' POSENC_REGISTER_DISPATCH (AVX2 only where POSENC_CPU_AVX2).
  static FnPtr DEFAULT;
  static FnPtr AVX2;

  // The entry point of the chosen capability, looked up once per stub.
  static FnPtr get() {
    static const FnPtr chosen = choose();
    return chosen;
  }

 private:
  static FnPtr choose() {
#if defined(POSENC_CPU_AVX2)
    if (cpu_capability() >= CpuCapability::kAvx2) return AVX2;
#endif
    return DEFAULT;
  }
};

// Raises TypeError naming the kernel and the dtype (defined in a plain translation unit, so
// that the ISA builds instantiate none of c10's error machinery: check_isa_symbols.sh).
[[noreturn]] void unsupported_kernel_dtype(const char* kernel, c10::ScalarType dtype);

POSENC_ISA_NAMESPACE_BEGIN
// f(static_cast<scalar_t*>(nullptr)) for the floating dtypes the kernels take: the ISA
// builds' dtype switch (AT_DISPATCH would instantiate c10's error paths in them).
template <typename F>
void dispatch_floating(c10::ScalarType dtype, const char* kernel, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float: return f(static_cast<float*>(nullptr));
    case c10::ScalarType::Double: return f(static_cast<double*>(nullptr));
    case c10::ScalarType::Half: return f(static_cast<c10::Half*>(nullptr));
    case c10::ScalarType::BFloat16: return f(static_cast<c10::BFloat16*>(nullptr));
    default: unsupported_kernel_dtype(kernel, dtype);
  }
}
POSENC_ISA_NAMESPACE_END

// In a header, at namespace posenc::ops::cpu: the stub type `name` of entry points of type
// fn_type (declaring the per-capability pointers that the ISA builds define).
#define POSENC_DECLARE_DISPATCH(fn_type, name)     \
  struct name##_tag;                               \
  using name = DispatchStub<fn_type, name##_tag>;  \
  template <>                                      \
  fn_type name::DEFAULT;                           \
  template <>                                      \
  fn_type name::AVX2;

// In an ISA translation unit, at namespace posenc::ops::cpu (outside the ISA namespace):
// this build's entry point of stub `name`.
#define POSENC_REGISTER_DISPATCH(name, fn) \
  template <>                              \
  name::Fn name::CPU_CAPABILITY = fn;

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
