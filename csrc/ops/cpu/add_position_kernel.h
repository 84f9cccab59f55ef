// Raw-pointer CPU kernels of add_position, compiled in their own translation unit with
// the host's vector ISA (AVX2 + FMA on x86-64, see CMakeLists.txt). Callers must check
// cpu_kernels_supported() first.
#pragma once

#include <cstdint>

#include "ops/add_position_args.h"

namespace posenc {
namespace ops {
namespace cpu {

// Dropout of one call: the (seed, offset) key plus the keep threshold and scale.
struct DropoutArgs {
  bool active = false;
  uint64_t seed = 0;
  uint64_t offset = 0;
  uint32_t threshold = 0;
  double scale = 1.0;
};

// out = dropout(x + table[position(row)]) for contiguous x/out rows of g.d elements.
template <typename scalar_t, typename table_t>
void add_position_rows(const AddPositionArgs& g, const scalar_t* x, const table_t* table,
                       const int64_t* positions, const DropoutArgs& draw, scalar_t* out);

// The fused backward for x and the table: reads grad once, writes grad_x (when not null)
// = grad * mask * scale, and accumulates the same values into the rows of grad_table
// (table_len x d, accumulation dtype, zero-initialised by the caller). Threads own
// column ranges and walk the rows in order, so the sums are bitwise deterministic.
template <typename scalar_t, typename acc_t>
void add_position_backward_rows(const AddPositionArgs& g, const scalar_t* grad,
                                const int64_t* positions, const DropoutArgs& draw,
                                scalar_t* grad_x, acc_t* grad_table);

// out = grad * mask * scale over n contiguous elements.
template <typename scalar_t>
void dropout_backward(const scalar_t* grad, int64_t n, const DropoutArgs& draw, scalar_t* out);

// False when the kernels were built for a vector ISA this CPU lacks.
bool cpu_kernels_supported();
const char* cpu_kernels_isa();

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
