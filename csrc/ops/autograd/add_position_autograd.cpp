// Autograd for posenc::add_position, registered in C++ so that LibTorch apps get gradients
// too. Forward and backward call the kernel ops through the dispatcher, which is what lets
// torch.compile trace them as graph nodes.
//
// Saved for backward: the (seed, offset) pair and the positions, never a mask or any
// tensor of x's size. d(out)/d(x) = mask * scale; d(out)/d(table) scatters that same
// gradient into the table rows that were read, summed over the batch.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/op_handles.h"

namespace posenc {
namespace ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Gradient of the table rows, accumulated in float32 (float64 for a float64 table).
at::Tensor table_gradient(const at::Tensor& grad_x, const at::Tensor& positions,
                          const c10::SymInt& offset, bool batch_first,
                          const c10::SymInt& table_len, int64_t table_dim,
                          at::ScalarType table_dtype) {
  const at::ScalarType acc = table_dtype == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t batch_dim = batch_first ? 0 : 1;
  at::Tensor grad_table;
  if (!positions.defined()) {
    // Rows offset .. offset + seq - 1, each read once per batch element.
    const at::Tensor summed = grad_x.sum({batch_dim}, false, acc);
    const c10::SymInt seq = summed.sym_size(0);
    grad_table = at::constant_pad_nd_symint(
        summed, {0, 0, offset, table_len - offset - seq}, 0);
  } else {
    const at::Tensor rows = batch_first ? grad_x : grad_x.transpose(0, 1);  // (B, S, d)
    const at::Tensor pos = positions.dim() == 1
                               ? positions.unsqueeze(0).expand_symint(
                                     {rows.sym_size(0), rows.sym_size(1)})
                               : positions;
    const at::Tensor zeros =
        at::zeros_symint({table_len, rows.sym_size(2)}, grad_x.options().dtype(acc));
    // index_put with accumulate is deterministic on CUDA (sort based).
    grad_table = at::index_put(zeros, {pos.reshape(-1)},
                               rows.reshape_symint({-1, rows.sym_size(2)}).to(acc), true);
  }
  grad_table = grad_table.to(table_dtype);
  return table_dim == 3 ? grad_table.unsqueeze(0) : grad_table;
}

class AddPositionFunction : public torch::autograd::Function<AddPositionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& table,
                               const std::optional<at::Tensor>& positions, c10::SymInt offset,
                               bool batch_first, double p) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rng] =
        add_position_forward_op().call(x, table, positions, offset, batch_first, p);
    ctx->save_for_backward({rng, positions.value_or(at::Tensor())});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["batch_first"] = batch_first;
    ctx->saved_data["p"] = p;
    ctx->saved_data["table_len"] = table.sym_size(-2);
    ctx->saved_data["table_dim"] = table.dim();
    ctx->saved_data["table_dtype"] = table.scalar_type();
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& rng = saved[0];
    const at::Tensor& positions = saved[1];
    const double p = ctx->saved_data["p"].toDouble();
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_x, grad_table;
    const bool want_x = ctx->needs_input_grad(0);
    const bool want_table = ctx->needs_input_grad(1);
    if (grad.defined() && (want_x || want_table)) {
      const at::Tensor masked = p > 0.0 ? add_position_backward_op().call(grad, rng, p) : grad;
      if (want_x) grad_x = masked;
      if (want_table) {
        grad_table = table_gradient(masked, positions, ctx->saved_data["offset"].toSymInt(),
                                    ctx->saved_data["batch_first"].toBool(),
                                    ctx->saved_data["table_len"].toSymInt(),
                                    ctx->saved_data["table_dim"].toInt(),
                                    ctx->saved_data["table_dtype"].toScalarType());
      }
    }
    return {grad_x, grad_table, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor add_position_autograd(const at::Tensor& x, const at::Tensor& table,
                                 const std::optional<at::Tensor>& positions, c10::SymInt offset,
                                 bool batch_first, double p) {
  return AddPositionFunction::apply(x, table, positions, std::move(offset), batch_first, p)[0];
}

// Below autograd (inference mode, or after the autograd kernel): just the forward.
at::Tensor add_position_no_grad(const at::Tensor& x, const at::Tensor& table,
                                const std::optional<at::Tensor>& positions, c10::SymInt offset,
                                bool batch_first, double p) {
  return std::get<0>(
      add_position_forward_op().call(x, table, positions, std::move(offset), batch_first, p));
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("add_position", &add_position_autograd);
}

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("add_position", &add_position_no_grad);
}

}  // namespace ops
}  // namespace posenc
