// CPU kernels of qk_norm_rope, compiled in the vector-ISA translation unit
// cpu/kernel.cpp once per capability (CMakeLists.txt); callers go through
// qk_norm_rope_stub (cpu_capability.h).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "ops/common/cpu/cpu_capability.h"
#include "ops/qk_norm_rope/qk_norm_rope_args.h"

namespace posenc {
namespace ops {
namespace cpu {

// The backward's weight gradients are summed per chunk of tokens (chunks of a fixed split
// of the tokens, whatever the thread count: deterministic), then over the chunks in order.
constexpr int64_t kQkNormMaxChunks = 64;
inline int64_t qk_norm_chunks(int64_t tokens) {
  return tokens < kQkNormMaxChunks ? tokens : kQkNormMaxChunks;
}

// Forward: a.rope.q.out / a.rope.k.out from the inputs. Backward: dx into the outs, and the
// weight gradients into a.q_weight_grad / a.k_weight_grad: (chunks, weight length) zeroed
// buffers of the compute type, whose row 0 holds the sums on return.
using QkNormRopeFn = void (*)(const QkNormRopeArgs& a, c10::ScalarType dtype, bool backward,
                              int64_t chunks);
POSENC_DECLARE_DISPATCH(QkNormRopeFn, qk_norm_rope_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
