// CPU kernel of apply_rope_cos_sin, compiled in the vector-ISA translation unit
// cpu/kernel.cpp once per capability (see CMakeLists.txt); callers go through
// rope_cos_sin_stub (cpu_capability.h). Plain data only (no ATen): RopeCosSinArgs is also
// what the CUDA kernel takes (cuda/rope_cos_sin/rope_cos_sin.cu, through its launch.h).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "ops/common/cpu/cpu_capability.h"
#include "ops/common/rope_args.h"
#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {

// What the apply_rope_cos_sin kernels read, as plain data shared by the CPU and CUDA
// kernels: q and k seen as (batch, seq, heads, head_dim) with element strides (RopeOperand,
// as the rope op), and the cos/sin tables, converted once to the compute dtype and made
// contiguous (table_batch, seq, rotary_dim), table_batch 1 (shared by every row) or batch.
struct RopeCosSinArgs {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // the tables' width; features beyond it pass through
  bool interleaved = false;
  bool transpose = false;  // the transposed rotation (the backward)
  RopeOperand q, k;
  const void* cos = nullptr;  // compute dtype (float32; float64 for float64 q)
  const void* sin = nullptr;
  int64_t table_batch_stride = 0;  // 0: one table for every batch row
};

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
