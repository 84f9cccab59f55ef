// The geometry of an add_position call, as plain data for the CPU and CUDA kernels. Kernel
// parameter structs are named <kernel>Args throughout (RopeArgs, AddPositionArgs, DropoutArgs).
#pragma once

#include <cstdint>

namespace posenc {
namespace ops {

// x is (batch, seq, d) when batch_first, (seq, batch, d) otherwise; the kernels see x as
// batch * seq contiguous rows of d elements in memory order.
struct AddPositionArgs {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t d = 0;
  int64_t table_len = 0;
  bool batch_first = true;
  bool has_positions = false;
  int64_t positions_batch_stride = 0;  // 0 for (S,) positions, seq for (B, S)
  int64_t offset = 0;
};

}  // namespace ops
}  // namespace posenc
