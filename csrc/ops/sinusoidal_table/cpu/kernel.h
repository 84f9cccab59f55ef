// The plain-data interface of sinusoidal_table's CPU kernel, compiled in the vector-ISA
// translation unit cpu/kernel.cpp once per capability; callers go through
// sinusoidal_table_stub.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "ops/common/cpu/cpu_capability.h"

namespace posenc {
namespace ops {

struct SinusoidalTableArgs {
  const double* positions = nullptr;  // rows positions, float64
  int64_t rows = 0;
  int64_t d_model = 0;
  const double* freq = nullptr;  // column j's frequency, math::sinusoid_inv_freq (d_model values)
  void* out = nullptr;           // rows x d_model, contiguous, of the kernel's dtype
};

namespace cpu {

// out[r, j] = math::sinusoid_value(positions[r], j, freq[j]) evaluated in float64 by libm and
// rounded once to dtype (float64, float32, bfloat16 or float16; a narrow dtype through
// float32, as ATen's cast of a float64 tensor rounds).
using SinusoidalTableFn = void (*)(const SinusoidalTableArgs& a, c10::ScalarType dtype);
POSENC_DECLARE_DISPATCH(SinusoidalTableFn, sinusoidal_table_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
