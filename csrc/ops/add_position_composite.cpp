// The table gradient composed from torch ops: add_position_backward_with_table for backends
// without a fused kernel (CompositeExplicitAutograd); table_gradient_composite, the
// differentiable form autograd uses under create_graph (twice-differentiable add_position);
// and scatter_rows_into_table, the deterministic row sum both build on.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/add_position_checks.h"
#include "ops/add_position_composite.h"
#include "ops/op_handles.h"

namespace posenc {
namespace ops {

// The masked gradient scattered into the table rows that were read, summed over the batch,
// in float32 (float64 for float64 grad). Deterministic: a reduction over the batch
// dimension, or index_put with accumulate, which is sort based on CUDA.
at::Tensor table_gradient_composite(const at::Tensor& grad_x, const at::Tensor& positions,
                                    const c10::SymInt& offset, bool batch_first,
                                    const c10::SymInt& table_len) {
  const at::ScalarType acc = grad_x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (!positions.defined()) {
    // Rows offset .. offset + seq - 1, each read once per batch element.
    const at::Tensor summed = grad_x.sum({batch_first ? 0 : 1}, false, acc);
    const c10::SymInt seq = summed.sym_size(0);
    return at::constant_pad_nd_symint(summed, {0, 0, offset, table_len - offset - seq}, 0);
  }
  const at::Tensor rows = batch_first ? grad_x : grad_x.transpose(0, 1);  // (B, S, d)
  const at::Tensor pos =
      positions.dim() == 1
          ? positions.unsqueeze(0).expand_symint({rows.sym_size(0), rows.sym_size(1)})
          : positions;
  return scatter_rows_into_table(pos.reshape(-1),
                                 rows.reshape_symint({-1, rows.sym_size(2)}).to(acc), table_len);
}

at::Tensor scatter_rows_into_table(const at::Tensor& positions, const at::Tensor& rows,
                                   const c10::SymInt& table_len) {
  // Out-of-range positions go to a spare last row, dropped by the narrow: no sync, no assert.
  const at::Tensor inside = positions.ge(0).logical_and(positions.lt(c10::Scalar(table_len)));
  const at::Tensor safe = at::where(inside, positions, c10::Scalar(table_len));
  at::Tensor table = at::zeros_symint({table_len + 1, rows.sym_size(1)}, rows.options());
  table.index_put_({safe}, rows, /*accumulate=*/true);
  return table.narrow_symint(0, 0, table_len);
}

namespace {

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_composite(
    const at::Tensor& grad, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, bool batch_first, double p, c10::SymInt table_len, bool need_x) {
  // The checks of the fused kernels (offset range, rng, p, positions layout).
  check_add_position_backward_inputs_if_concrete(grad, rng, positions, offset, batch_first, p,
                                                 table_len);
  const at::Tensor masked = p > 0.0 ? add_position_backward_op().call(grad, rng, p) : grad;
  at::Tensor grad_table = table_gradient_composite(masked, positions.value_or(at::Tensor()),
                                                   offset, batch_first, table_len);
  at::Tensor grad_x = !need_x ? at::empty({0}, grad.options())
                              : (p > 0.0 ? masked : grad.clone(at::MemoryFormat::Contiguous));
  return {grad_x, grad_table};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("add_position_backward_with_table", &add_position_backward_with_table_composite);
}

}  // namespace ops
}  // namespace posenc
