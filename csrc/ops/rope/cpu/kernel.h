// CPU kernel of the rope ops, compiled in the vector-ISA translation unit cpu/kernel.cpp
// once per capability (see CMakeLists.txt); callers go through rope_stub (cpu_capability.h).
#pragma once

#include <c10/core/ScalarType.h>

#include "ops/common/cpu/cpu_capability.h"
#include "ops/common/rope_args.h"
#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {
namespace cpu {

POSENC_ISA_NAMESPACE_BEGIN
// Rotates q and k of `a` (out of place, or in place when out == in), all tokens.
template <typename scalar_t>
void rope_tokens(const RopeArgs& a);
POSENC_ISA_NAMESPACE_END

// rope_tokens for q's dtype.
using RopeFn = void (*)(const RopeArgs& a, c10::ScalarType dtype);
POSENC_DECLARE_DISPATCH(RopeFn, rope_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
