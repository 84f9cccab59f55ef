// The plain-data interface of add_position's kernels: the geometry of a call
// (AddPositionArgs, which the CUDA kernels take too, through cuda/add_position/launch.h) and the CPU
// kernels, compiled in their own translation unit once per vector ISA (cpu/kernel.cpp,
// POSENC_ISA_SOURCES in CMakeLists.txt); callers reach the build of the chosen capability
// through the stubs at the end (cpu_capability.h). Plain data only (no ATen): the ISA
// builds include it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "ops/common/cpu/cpu_capability.h"
#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {

// The geometry of an add_position call, as plain data for the CPU and CUDA kernels. Kernel
// parameter structs are named <kernel>Args throughout (RopeArgs, AddPositionArgs, DropoutArgs).
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
  // The backward: (S,) positions strictly increasing, so every s has its own table row (set
  // also for (B, S) positions whose rows are all that one row, with positions_batch_stride 0).
  bool positions_distinct = false;
  int64_t offset = 0;
  // The backward's table gradient holds rows table_row_base .. (a window of the table: the
  // rows positions read); the forward's table is whole.
  int64_t table_row_base = 0;
};

namespace cpu {

// Dropout of one call: the (seed, offset) key plus the keep threshold and scale.
//
// The saved keep mask (CPU training only, add_position_forward with save_mask=True): one bit
// per element, row by row, bit j % 8 of byte r * keep_row_bytes(d) + j / 8 for element j of
// row r (rows padded to whole bytes, so threads owning different rows never share a byte;
// padding bits are 0). The forward writes it to keep_bits_out; the backward reads keep_bits
// instead of regenerating the mask with Philox. The bits are the Philox keep decisions, so
// both backward paths give the same results bit for bit.
struct DropoutArgs {
  bool active = false;
  uint64_t seed = 0;
  uint64_t offset = 0;
  uint32_t threshold = 0;
  double keep_prob = 1.0;  // 1 - p: survivors scaled by math::dropout_scale of it
  uint8_t* keep_bits_out = nullptr;
  const uint8_t* keep_bits = nullptr;
};

// Bytes of one row of the saved keep mask.
inline int64_t keep_row_bytes(int64_t d) { return (d + 7) / 8; }

// The raw-pointer kernels, one copy per ISA build (its translation unit only).
POSENC_ISA_NAMESPACE_BEGIN

// out = dropout(x + table[position(row)]) for contiguous x/out rows of g.d elements; also
// writes the keep mask when draw.keep_bits_out is set.
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

// out = grad * mask * scale over rows x d contiguous elements (the mask from draw.keep_bits
// when set, else regenerated from the key; then any rows x d split of the same count works).
template <typename scalar_t>
void dropout_backward(const scalar_t* grad, int64_t rows, int64_t d, const DropoutArgs& draw,
                      scalar_t* out);

POSENC_ISA_NAMESPACE_END

// The entry points: the kernels above for the dtype `dtype` of x / grad (contiguous data,
// non-empty, shaped as checked by the caller; pointers to elements of that dtype unless
// said otherwise).
//
// add_position_rows; the table (table_len, d) is in x's dtype, or in its opmath dtype
// (float32, float64 for float64) when wide_table.
using AddPositionForwardFn = void (*)(const AddPositionArgs& g, c10::ScalarType dtype,
                                      bool wide_table, const void* x, const void* table,
                                      const int64_t* positions, const DropoutArgs& draw, void* out);
POSENC_DECLARE_DISPATCH(AddPositionForwardFn, add_position_forward_stub)

// add_position_backward_rows; grad_x null when not wanted. grad_table: with positions, rows
// g.table_row_base .. of the table (the whole table, or a window of it) in the opmath dtype,
// zeroed, added into; without positions the (table_len, d) table, whose rows offset .. offset
// + seq - 1 are written (not added) and the rest left as they are, in the opmath dtype or in
// grad's (table_in_grad_dtype: no positions only).
using AddPositionBackwardFn = void (*)(const AddPositionArgs& g, c10::ScalarType dtype,
                                       const void* grad, const int64_t* positions,
                                       const DropoutArgs& draw, void* grad_x, void* grad_table,
                                       bool table_in_grad_dtype);
POSENC_DECLARE_DISPATCH(AddPositionBackwardFn, add_position_backward_stub)

// dropout_backward of grad as rows x d into out.
using DropoutBackwardFn = void (*)(c10::ScalarType dtype, const void* grad, int64_t rows,
                                   int64_t d, const DropoutArgs& draw, void* out);
POSENC_DECLARE_DISPATCH(DropoutBackwardFn, dropout_backward_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
