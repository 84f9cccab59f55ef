// Backend kernels of the posenc ops, one set per dispatch key. Registration lives with
// each backend (cpu/*.cpp, ../cuda/*.cu, meta_kernels.cpp); autograd calls the ops back
// through the dispatcher, never these functions directly.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace posenc {
namespace ops {

// add_position_forward: (dropout(x + table[positions]), rng). rng is an int64 tensor on
// x's device holding (seed, offset) of the dropout draw, or empty when p == 0.
using AddPositionForwardFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& x, const at::Tensor& table, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p);

// add_position_backward: grad * mask * scale, the mask regenerated from rng.
using AddPositionBackwardFn = at::Tensor(const at::Tensor& grad, const at::Tensor& rng, double p);

// add_position_backward_with_table: (grad_x or empty, table gradient in float32/64).
using AddPositionBackwardWithTableFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& grad, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, int64_t table_len, bool need_x);

// rows (n, d) summed into a zero (table_len, d) table at positions (n,), deterministically
// (sort-based index_put on CUDA). A position outside [0, table_len) adds nothing: such
// positions reach a backward only unchecked on CUDA (the forward wrote NaN rows for them),
// and index_put would device-assert on them, or wrap negative ones.
at::Tensor scatter_rows_into_table(const at::Tensor& positions, const at::Tensor& rows,
                                   const c10::SymInt& table_len);

// The table gradient from the masked gradient of x (grad * mask * scale), in float32
// (float64 for float64 grad), made of differentiable torch ops: the composite backend and
// the create_graph path of autograd (twice-differentiable add_position) use it.
// positions: undefined for rows offset .. offset + seq - 1.
at::Tensor table_gradient_composite(const at::Tensor& masked_grad, const at::Tensor& positions,
                                    const c10::SymInt& offset, bool batch_first,
                                    const c10::SymInt& table_len);

// The composite implementation (any backend), see add_position_composite.cpp.
std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_composite(
    const at::Tensor& grad, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, bool batch_first, double p, c10::SymInt table_len, bool need_x);

AddPositionForwardFn add_position_forward_cpu;
AddPositionBackwardWithTableFn add_position_backward_with_table_cpu;
AddPositionBackwardFn add_position_backward_cpu;

at::Tensor sinusoidal_table_cpu(const at::Tensor& positions, int64_t d_model, double base,
                                std::optional<at::ScalarType> dtype);

}  // namespace ops
}  // namespace posenc
