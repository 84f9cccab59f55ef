// CPU kernel of rope_append_kv, compiled in the vector-ISA translation unit
// cpu/kernel.cpp once per capability; callers go through rope_append_kv_stub.
#pragma once

#include <c10/core/ScalarType.h>

#include "ops/common/cpu/cpu_capability.h"
#include "ops/rope_append_kv/rope_append_kv_args.h"

namespace posenc {
namespace ops {
namespace cpu {

// Rotates q (and k) of `a` and writes the rotated k and v into the caches, all tokens; every
// row is in range (checked before).
using RopeAppendKvFn = void (*)(const KvCacheArgs& a, c10::ScalarType dtype);
POSENC_DECLARE_DISPATCH(RopeAppendKvFn, rope_append_kv_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
