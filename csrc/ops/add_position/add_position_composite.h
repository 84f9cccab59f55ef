// Pieces of the add_position backward made of torch ops (add_position_composite.cpp, which
// also registers the composite backend of add_position_backward_with_table), reused by the
// CUDA backend and the create_graph path of autograd. Backend kernels themselves are file-local, each
// registered in its own file (cpu/, ../cuda/, meta/, rope/).
#pragma once

#include <ATen/ATen.h>


namespace posenc {
namespace ops {

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
