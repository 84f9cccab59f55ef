// What the apply_rope_cos_sin kernels read, as plain data shared by the CPU and CUDA
// kernels: q and k seen as (batch, seq, heads, head_dim) with element strides (RopeOperand,
// as the rope op), and the cos/sin tables, converted once to the compute dtype and made
// contiguous (table_batch, seq, rotary_dim), table_batch 1 (shared by every row) or batch.
#pragma once

#include <cstdint>

#include "ops/common/rope_args.h"

namespace posenc {
namespace ops {

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

}  // namespace ops
}  // namespace posenc
