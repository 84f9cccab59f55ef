// Autograd for posenc::add_position, registered in C++ so that LibTorch apps get gradients
// too. Forward and backward call the kernel ops through the dispatcher, which is what lets
// torch.compile trace them as graph nodes.
//
// Saved for backward: the dropout state and the positions. The state is the (seed, offset)
// pair on CUDA, where the backward regenerates the mask, so no tensor of x's size is saved;
// on the CPU it is the keep mask, 1 bit per element (1/32 of float32 x), because reading it
// is cheaper there than running Philox again (benchmarks/NOTES.md, "CPU backward").
// d(out)/d(x) = mask * scale; d(out)/d(table) scatters that same gradient into the table
// rows that were read, summed over the batch.
//
// Higher derivatives (create_graph=True): add_position_backward has its own autograd (it is
// linear in grad with the same mask: its own derivative), and with grad mode on the table
// gradient is made of differentiable torch ops instead of the fused kernel.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/add_position/add_position.h"
#include "ops/common/op_handles.h"

namespace posenc {
namespace ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class AddPositionFunction : public torch::autograd::Function<AddPositionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& table,
                               const std::optional<at::Tensor>& positions, c10::SymInt offset,
                               bool batch_first, double p, bool save_mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rng] =
        add_position_forward_op().call(x, table, positions, offset, batch_first, p, save_mask);
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
    if (grad.defined() && want_table && at::GradMode::is_enabled()) {
      // create_graph: every step differentiable (see the file comment).
      const at::Tensor masked = p > 0.0 ? add_position_backward_op().call(grad, rng, p) : grad;
      const at::Tensor gt = table_gradient_composite(
          masked, positions, ctx->saved_data["offset"].toSymInt(),
          ctx->saved_data["batch_first"].toBool(), ctx->saved_data["table_len"].toSymInt());
      grad_table = table_gradient_as_table(ctx, gt);
      if (want_x) grad_x = masked;
    } else if (grad.defined() && want_table) {
      // One fused pass: grad read once, grad_x (when p > 0) and the table gradient.
      const bool masked_x = want_x && p > 0.0;
      auto [gx, gt] = add_position_backward_with_table_op().call(
          grad, rng, positions.defined() ? std::optional<at::Tensor>(positions) : std::nullopt,
          ctx->saved_data["offset"].toSymInt(), ctx->saved_data["batch_first"].toBool(), p,
          ctx->saved_data["table_len"].toSymInt(), masked_x);
      grad_table = table_gradient_as_table(ctx, gt);
      if (want_x) grad_x = masked_x ? gx : grad;
    } else if (grad.defined() && want_x) {
      grad_x = p > 0.0 ? add_position_backward_op().call(grad, rng, p) : grad;
    }
    return {grad_x,      grad_table,  at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }

 private:
  // The (table_len, d) accumulated gradient in the table's dtype and rank.
  static at::Tensor table_gradient_as_table(AutogradContext* ctx, const at::Tensor& gt) {
    const at::Tensor cast = gt.to(ctx->saved_data["table_dtype"].toScalarType());
    return ctx->saved_data["table_dim"].toInt() == 3 ? cast.unsqueeze(0) : cast;
  }
};

// grad * mask * scale is linear in grad with a fixed mask, so its derivative is the op
// itself, applied to the incoming gradient; rng and p are not differentiable.
class AddPositionBackwardFunction : public torch::autograd::Function<AddPositionBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& rng,
                            double p) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({rng});
    ctx->saved_data["p"] = p;
    return add_position_backward_op().call(grad, rng, p);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& g = grad_outputs[0];
    at::Tensor grad_grad;
    if (g.defined()) {
      grad_grad = add_position_backward_op().call(g, ctx->get_saved_variables()[0],
                                                  ctx->saved_data["p"].toDouble());
    }
    return {grad_grad, at::Tensor(), at::Tensor()};
  }
};

at::Tensor add_position_backward_autograd(const at::Tensor& grad, const at::Tensor& rng, double p) {
  return AddPositionBackwardFunction::apply(grad, rng, p);
}

at::Tensor add_position_autograd(const at::Tensor& x, const at::Tensor& table,
                                 const std::optional<at::Tensor>& positions, c10::SymInt offset,
                                 bool batch_first, double p) {
  const bool record = at::GradMode::is_enabled() && (x.requires_grad() || table.requires_grad());
  // Forward-mode tangents still go to the autograd Function (which refuses them) rather
  // than being dropped.
  const bool tangents = x._fw_grad(/*level=*/0).defined() || table._fw_grad(/*level=*/0).defined();
  if (!record && !tangents) {
    // No graph to record (eval with a buffer table, no_grad): the forward alone, without
    // the autograd node and its saved state, which cost a small call as much as the kernel
    // (benchmarks/NOTES.md, "The cost of one small call").
    at::AutoDispatchBelowADInplaceOrView guard;
    return std::get<0>(add_position_forward_op().call(x, table, positions, std::move(offset),
                                                      batch_first, p, /*save_mask=*/false));
  }
  // The mask is saved only where a backward will read it: CPU, dropout, a graph recorded.
  const bool save_mask = p > 0.0 && x.device().is_cpu();
  return AddPositionFunction::apply(x, table, positions, std::move(offset), batch_first, p,
                                    save_mask)[0];
}

// Below autograd (inference mode, or after the autograd kernel): just the forward.
at::Tensor add_position_no_grad(const at::Tensor& x, const at::Tensor& table,
                                const std::optional<at::Tensor>& positions, c10::SymInt offset,
                                bool batch_first, double p) {
  return std::get<0>(
      add_position_forward_op().call(x, table, positions, std::move(offset), batch_first, p,
                                     /*save_mask=*/false));
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("add_position", &add_position_autograd);
  m.impl("add_position_backward", &add_position_backward_autograd);
}

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("add_position", &add_position_no_grad);
}

}  // namespace ops
}  // namespace posenc
