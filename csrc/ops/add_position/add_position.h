// The add_position family (ops add_position, add_position_forward, add_position_backward,
// add_position_backward_with_table, position_bounds, position_range_check, position_run_check): what its files
// share. add_position.cpp defines the schemas, the checks, the Meta kernels, the ATen
// composite and the CPU and CUDA registrations; autograd.cpp the C++ autograd; the CUDA
// kernels are in cuda/add_position/. The kernels' plain data (AddPositionArgs, cpu::DropoutArgs) is in
// cpu/kernel.h, which the vector-ISA unit includes without ATen.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "ops/add_position/cpu/kernel.h"  // AddPositionArgs (plain data)

namespace posenc {
namespace ops {

// ---- Argument checks (add_position.cpp), shared by the CPU, CUDA and Meta kernels so that
// every backend rejects the same inputs with the same message.

// The arguments of add_position_backward on every backend: rng, the dropout state a forward
// returned (the kernels read it whatever p): the int64 (seed, offset) pair on grad's device,
// or, on the CPU only, the uint8 keep mask of save_mask=True, of shape (grad.size(0),
// grad.size(1), ceil(grad.size(2) / 8)); p in [0, 1]; grad's dtype.
void check_dropout_backward_args(const at::Tensor& grad, const at::Tensor& rng, double p);

// Full checks for a real kernel: shapes, dtypes, devices and p, then the offset/sequence
// range. Position values are checked by the caller where reading them costs no device sync.
AddPositionArgs check_add_position_inputs(const at::Tensor& x, const at::Tensor& table,
                                          const std::optional<at::Tensor>& positions,
                                          int64_t offset, bool batch_first, double p);

// Checks of the fused backward (grad, rng, positions, offset, table_len), as in the forward.
AddPositionArgs check_add_position_backward_inputs(const at::Tensor& grad, const at::Tensor& rng,
                                                   const std::optional<at::Tensor>& positions,
                                                   int64_t offset, bool batch_first, double p,
                                                   int64_t table_len);

// The table as a contiguous (max_len, d) matrix whose dtype the kernels accept: x's
// own dtype or float32 (float64 for float64 x); any other dtype is converted.
at::Tensor table_as_matrix(const at::Tensor& table, at::ScalarType x_dtype);

// ---- Pieces of the backward made of torch ops (add_position.cpp, beside the composite
// kernels), reused by the CUDA backend and the create_graph path of autograd.

// rows (n, d) summed into a zero (table_len, d) table at positions (n,), deterministically
// (sort-based index_put on CUDA). A position outside [0, table_len) adds nothing: the
// forward's kernels refuse such positions (CPU IndexError, CUDA device-side assert), so only
// a direct call of the backward op brings them, and index_put would device-assert on them,
// or wrap negative ones.
at::Tensor scatter_rows_into_table(const at::Tensor& positions, const at::Tensor& rows,
                                   const c10::SymInt& table_len);

// The table gradient from the masked gradient of x (grad * mask * scale), in float32
// (float64 for float64 grad), made of differentiable torch ops: the composite backend and
// the create_graph path of autograd (twice-differentiable add_position) use it.
// positions: undefined for rows offset .. offset + seq - 1.
at::Tensor table_gradient_composite(const at::Tensor& masked_grad, const at::Tensor& positions,
                                    const c10::SymInt& offset, bool batch_first,
                                    const c10::SymInt& table_len);

}  // namespace ops
}  // namespace posenc
