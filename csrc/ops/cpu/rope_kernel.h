// Raw-pointer CPU kernel of the rope ops, compiled in the vector-ISA translation unit
// rope_kernel.cpp (see CMakeLists.txt). Callers check cpu_kernels_supported() first.
#pragma once

#include "ops/rope/rope_args.h"

namespace posenc {
namespace ops {
namespace cpu {

// Rotates q and k of `a` (out of place, or in place when out == in), all tokens.
template <typename scalar_t>
void rope_tokens(const RopeArgs& a);

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
