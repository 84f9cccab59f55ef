// Autograd for posenc::sinusoidal_table with floating-point positions (continuous times,
// fractional positions): d PE(pos, j) / d pos = f_j cos(pos f_j) for sine columns and
// -f_j sin(pos f_j) for cosine columns, f_j = base^(-2 floor(j/2) / d) as in
// posenc/math/sinusoid.h. The backward is composed from torch ops in float64.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

#include "ops/common/op_handles.h"

namespace posenc {
namespace ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class SinusoidalTableFunction : public torch::autograd::Function<SinusoidalTableFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& positions,
                               c10::SymInt d_model, double base) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({positions});
    ctx->saved_data["base"] = base;
    return {sinusoidal_table_op().call(positions, d_model, base)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor positions = ctx->get_saved_variables()[0];
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_positions;
    if (grad.defined() && ctx->needs_input_grad(0)) {
      const double base = ctx->saved_data["base"].toDouble();
      const auto options = positions.options().dtype(at::kDouble);
      const at::Tensor column = at::arange(grad.sym_size(-1), options);
      const at::Tensor parity = column.remainder(2);
      const at::Tensor freq = at::exp(-(column - parity) * std::log(base) / grad.sym_size(-1));
      const at::Tensor angle = positions.to(at::kDouble).unsqueeze(-1) * freq;
      const at::Tensor slope = at::where(parity.eq(0), at::cos(angle), -at::sin(angle)) * freq;
      grad_positions = (grad.to(at::kDouble) * slope).sum(-1).to(positions.scalar_type());
    }
    return {grad_positions, at::Tensor(), at::Tensor()};
  }
};

at::Tensor sinusoidal_table_autograd(const at::Tensor& positions, c10::SymInt d_model,
                                     double base) {
  return SinusoidalTableFunction::apply(positions, std::move(d_model), base)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_autograd);
}

}  // namespace ops
}  // namespace posenc
