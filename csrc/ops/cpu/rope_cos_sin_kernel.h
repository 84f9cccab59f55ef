// Raw-pointer CPU kernel of apply_rope_cos_sin, compiled in the vector-ISA translation unit
// rope_cos_sin_kernel.cpp (see CMakeLists.txt). Callers check the CPU first (check_cpu_isa).
#pragma once

#include "ops/rope/rope_cos_sin_args.h"

namespace posenc {
namespace ops {
namespace cpu {

// Rotates q and k of `a` into their outputs (fresh tensors), all tokens.
template <typename scalar_t>
void rope_cos_sin_tokens(const RopeCosSinArgs& a);

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
