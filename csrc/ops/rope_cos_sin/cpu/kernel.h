// CPU kernel of apply_rope_cos_sin, compiled in the vector-ISA translation unit
// rope_cos_sin_kernel.cpp once per capability (see CMakeLists.txt); callers go through
// rope_cos_sin_stub (cpu_capability.h).
#pragma once

#include <c10/core/ScalarType.h>

#include "ops/common/cpu/cpu_capability.h"
#include "ops/rope_cos_sin/rope_cos_sin_args.h"
#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {
namespace cpu {

POSENC_ISA_NAMESPACE_BEGIN
// Rotates q and k of `a` into their outputs (fresh tensors), all tokens.
template <typename scalar_t>
void rope_cos_sin_tokens(const RopeCosSinArgs& a);
POSENC_ISA_NAMESPACE_END

// rope_cos_sin_tokens for q's dtype.
using RopeCosSinFn = void (*)(const RopeCosSinArgs& a, c10::ScalarType dtype);
POSENC_DECLARE_DISPATCH(RopeCosSinFn, rope_cos_sin_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
