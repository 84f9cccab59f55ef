// Autograd of posenc::add_position, add_position_forward and add_position_backward, in C++ so
// that LibTorch apps get gradients too, written as PyTorch's own ops write theirs
// (common/autograd_node.h), so torch.func's transforms and forward-mode AD take them as well.
// Forward and backward call the kernel ops through the dispatcher, which is what lets
// torch.compile trace them as graph nodes. add_position's kernel only chooses what to save
// (the fast path, the CPU mask) and calls add_position_forward, whose kernel holds the node
// and the tangent (see there why).
//
// out = dropout(x + table[rows]) = (x + table[rows]) * mask * scale, linear in x and table.
// - backward: d(out)/d(x) = mask * scale, i.e. add_position_backward(grad, rng, p); the table
//   gradient scatters that same gradient into the table rows that were read, summed over the
//   batch (one fused pass when no graph is built; differentiable torch ops under grad mode:
//   create_graph, torch.func.grad, jacrev, hessian).
// - forward (jvp): the tangent is the op itself on the tangents with the same mask:
//   add_position_backward(add_position(x_t, table_t, p=0), rng, p), i.e. x_t + table_t[rows]
//   in one fused call, then the primal's mask (no second draw). Without a table tangent the
//   first call is the identity and is skipped.
//
// Saved: the dropout state and the positions. The state is the (seed, offset) pair on CUDA,
// where the backward regenerates the mask, so no tensor of x's size is saved; on the CPU it is
// the keep mask, 1 bit per element (1/32 of float32 x), because reading it is cheaper there
// than running Philox again (a CPU core computes Philox slower than it reads 1 bit per element). The state is kept whenever
// a backward or a tangent reads it: a graph recorded, or a tangent (forward AD alone too).
//
// add_position_backward (grad * mask * scale) is linear in grad with a fixed mask: its own
// derivative, backward and forward; rng and p are not differentiable.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/add_position/add_position.h"
#include "ops/common/autograd_node.h"
#include "ops/common/op_handles.h"

namespace posenc {
namespace ops {
namespace {

namespace ag = autograd;

// grad * mask * scale with the mask of rng, through the dispatcher (differentiable).
at::Tensor apply_mask(const at::Tensor& grad, const at::Tensor& rng, double p) {
  return p > 0.0 ? add_position_backward_op().call(grad, rng, p) : grad;
}

struct AddPositionBackward : ag::Node {
  ag::SavedVariable rng, positions;
  c10::SymInt offset = 0, table_len = 0;
  bool batch_first = true;
  double p = 0.0;
  int64_t table_dim = 2;
  at::ScalarType table_dtype = at::kFloat;

  std::string name() const override { return "posenc::AddPositionBackward"; }
  void release_variables() override {
    rng.reset_data();
    positions.reset_data();
  }

  // The (table_len, d) accumulated gradient in the table's dtype and rank.
  at::Tensor as_table(const at::Tensor& gt) const {
    const at::Tensor cast = gt.to(table_dtype);
    return table_dim == 3 ? cast.unsqueeze(0) : cast;
  }

  ag::variable_list apply(ag::variable_list&& grads) override {
    const at::Tensor& grad = grads[0];
    const bool want_x = should_compute_output(0);
    const bool want_table = should_compute_output(1);
    at::Tensor grad_x, grad_table;
    if (!grad.defined() || (!want_x && !want_table)) return {grad_x, grad_table};
    const at::Tensor mask_state = rng.unpack();
    const at::Tensor pos = positions.unpack();
    if (want_table && (at::GradMode::is_enabled() || ag::has_tangent(grad))) {
      // A graph of the backward is being built, or grad carries a tangent: every step
      // differentiable.
      const at::Tensor masked = apply_mask(grad, mask_state, p);
      grad_table = as_table(table_gradient_composite(masked, pos, offset, batch_first, table_len));
      if (want_x) grad_x = masked;
    } else if (want_table) {
      // One fused pass: grad read once, grad_x (when p > 0) and the table gradient.
      const bool masked_x = want_x && p > 0.0;
      auto [gx, gt] = add_position_backward_with_table_op().call(
          grad, mask_state, pos.defined() ? std::optional<at::Tensor>(pos) : std::nullopt,
          offset, batch_first, p, table_len, masked_x, table_dtype);
      grad_table = as_table(gt);
      if (want_x) grad_x = masked_x ? gx : grad;
    } else {
      grad_x = apply_mask(grad, mask_state, p);
    }
    return {grad_x, grad_table};
  }
};

// add_position_forward, differentiable in x and table through out (rng is the dropout state,
// not differentiable). The node and the tangent live here rather than on add_position, because
// a kernel's call below autograd reaches the next torch.func level as the op it calls: nested
// transforms (hessian, jacfwd of jacrev, grad of grad) differentiate add_position_forward.
std::tuple<at::Tensor, at::Tensor> add_position_forward_autograd(
    const at::Tensor& x, const at::Tensor& table, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, bool batch_first, double p, bool save_mask) {
  auto node = ag::make_node<AddPositionBackward>(x, table);
  at::Tensor out, rng;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, rng) =
        add_position_forward_op().call(x, table, positions, offset, batch_first, p, save_mask);
  }
  if (node) {
    node->rng = ag::SavedVariable(rng, /*is_output=*/false);
    node->positions = ag::save(positions);
    node->offset = offset;
    node->table_len = table.sym_size(-2);
    node->batch_first = batch_first;
    node->p = p;
    node->table_dim = table.dim();
    node->table_dtype = table.scalar_type();
    ag::record(node, out);
  }
  if (ag::has_tangent(x, table)) {
    const at::Tensor x_t = ag::tangent(x);
    const at::Tensor table_t = ag::tangent(table);
    at::Tensor t;
    if (table_t.defined()) {
      // x_t + table_t[rows] in one fused call (no dropout: the primal's mask follows), in the
      // tangents' dtype (the op returns x_t's: a float32 table tangent is not rounded to x's
      // float16).
      const at::ScalarType dtype = ag::tangent_dtype(out, x, table);
      const at::Tensor xt = x_t.defined() ? x_t.to(dtype) : at::zeros_symint(x.sym_sizes(), x.options().dtype(dtype));
      t = add_position_op().call(xt, table_t, positions, offset, batch_first, 0.0);
    } else {
      // A new tensor, not x's tangent itself (an in-place op on out updates out's tangent).
      t = p > 0.0 ? x_t : x_t.clone();
    }
    ag::set_tangent(out, apply_mask(t, rng, p));
  }
  return {std::move(out), std::move(rng)};
}

at::Tensor add_position_autograd(const at::Tensor& x, const at::Tensor& table,
                                 const std::optional<at::Tensor>& positions, c10::SymInt offset,
                                 bool batch_first, double p) {
  if (!torch::autograd::compute_requires_grad(x, table) && !ag::has_tangent(x, table)) {
    // No graph to record (eval with a buffer table, no_grad) and no tangent: the forward
    // alone, without the autograd node and its saved state, which cost a small call as much
    // as the kernel for the small calls of decoding.
    at::AutoDispatchBelowADInplaceOrView guard;
    return std::get<0>(add_position_forward_op().call(x, table, positions, std::move(offset),
                                                      batch_first, p, /*save_mask=*/false));
  }
  // The mask is saved (CPU, dropout) for whoever reads it: the backward, the tangent.
  const bool save_mask = p > 0.0 && x.device().is_cpu();
  return std::get<0>(add_position_forward_op().call(x, table, positions, std::move(offset),
                                                    batch_first, p, save_mask));
}

struct AddPositionBackwardBackward : ag::Node {
  ag::SavedVariable rng;
  double p = 0.0;

  std::string name() const override { return "posenc::AddPositionBackwardBackward"; }
  void release_variables() override { rng.reset_data(); }
  ag::variable_list apply(ag::variable_list&& grads) override {
    const at::Tensor& g = grads[0];
    if (!g.defined() || !should_compute_output(0)) return {at::Tensor()};
    return {add_position_backward_op().call(g, rng.unpack(), p)};
  }
};

at::Tensor add_position_backward_autograd(const at::Tensor& grad, const at::Tensor& rng, double p) {
  auto node = ag::make_node<AddPositionBackwardBackward>(grad);
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = add_position_backward_op().call(grad, rng, p);
  }
  if (node) {
    node->rng = ag::SavedVariable(rng, /*is_output=*/false);
    node->p = p;
    ag::record(node, out);
  }
  if (ag::has_tangent(grad)) {
    ag::set_tangent(out, add_position_backward_op().call(ag::tangent(grad), rng, p));
  }
  return out;
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
  m.impl("add_position", absent_if_undefined<&add_position_autograd>);
  m.impl("add_position_forward", absent_if_undefined<&add_position_forward_autograd>);
  m.impl("add_position_backward", &add_position_backward_autograd);
}

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("add_position", absent_if_undefined<&add_position_no_grad>);
}

}  // namespace ops
}  // namespace posenc
