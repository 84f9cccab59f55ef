// Autograd of posenc::sinusoidal_table with floating-point positions (continuous times,
// fractional positions), written as PyTorch's own ops write theirs (common/autograd_node.h),
// so torch.func's transforms and forward-mode AD take it as well.
//
// d PE(pos, j) / d pos = slope(pos, j) = f_j cos(pos f_j) for sine columns and
// -f_j sin(pos f_j) for cosine columns, f_j = base^(-2 floor(j/2) / d) as in
// posenc/math/sinusoid.h. One definition of the slope (sinusoid_slope) serves both modes:
// - backward: grad_pos = sum_j grad_j slope_j;
// - forward (jvp): out_t = slope * pos_t.
// It is made of torch ops in float64, called with grad mode as found, so it is differentiable
// itself (double backward, hessian, jacfwd of jacrev). Integer positions get no gradient.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "ops/common/autograd_node.h"
#include "ops/common/op_handles.h"

namespace posenc {
namespace ops {
namespace {

namespace ag = autograd;

// slope(pos, j), shape positions.shape + (d_model,), float64: the derivative of the table's
// column j at pos, with the frequencies of math::sinusoid_inv_freq,
// exp(-(j - j % 2) * ln(base) / d_model).
at::Tensor sinusoid_slope(const at::Tensor& positions, const c10::SymInt& d_model, double base) {
  const auto options = positions.options().dtype(at::kDouble);
  const at::Tensor column = at::arange(d_model, options);
  const at::Tensor parity = column.remainder(2);
  const at::Tensor freq = at::exp((parity - column) * std::log(base) / d_model);
  const at::Tensor angle = positions.to(at::kDouble).unsqueeze(-1) * freq;
  return at::where(parity.eq(0), at::cos(angle), -at::sin(angle)) * freq;
}

struct SinusoidalTableBackward : ag::Node {
  ag::SavedVariable positions;
  c10::SymInt d_model = 0;
  double base = 10000.0;

  std::string name() const override { return "posenc::SinusoidalTableBackward"; }
  void release_variables() override { positions.reset_data(); }
  ag::variable_list apply(ag::variable_list&& grads) override {
    const at::Tensor& grad = grads[0];
    if (!grad.defined() || !should_compute_output(0)) return {at::Tensor()};
    const at::Tensor pos = positions.unpack();
    const at::Tensor slope = sinusoid_slope(pos, d_model, base);
    return {(grad.to(at::kDouble) * slope).sum(-1).to(pos.scalar_type())};
  }
};

at::Tensor sinusoidal_table_autograd(const at::Tensor& positions, c10::SymInt d_model,
                                     double base, c10::string_view dtype) {
  auto node = ag::make_node<SinusoidalTableBackward>(positions);
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = sinusoidal_table_op().call(positions, d_model, base, dtype);
  }
  if (node) {
    node->positions = ag::SavedVariable(positions, /*is_output=*/false);
    node->d_model = d_model;
    node->base = base;
    ag::record(node, out);
  }
  const at::Tensor pos_t = ag::tangent(positions);
  if (pos_t.defined()) {
    // The slope at the primal (a tangent must not carry one of its own at the same level);
    // _fw_primal keeps the backward history, so grad of jvp still differentiates it.
    ag::set_tangent(out, (sinusoid_slope(positions._fw_primal(/*level=*/0), d_model, base) *
                          pos_t.to(at::kDouble).unsqueeze(-1))
                             .to(out.scalar_type()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_autograd);
}

}  // namespace ops
}  // namespace posenc
