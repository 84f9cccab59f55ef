// Meta kernels: shapes and dtypes only, with symbolic sizes, so torch.compile and
// torch.export trace every posenc op without running it or breaking the graph.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/add_position_checks.h"

namespace posenc {
namespace ops {
namespace {

std::tuple<at::Tensor, at::Tensor> add_position_forward_meta(
    const at::Tensor& x, const at::Tensor& table, const std::optional<at::Tensor>& positions,
    c10::SymInt /*offset*/, bool batch_first, double p) {
  check_add_position_structure(x, table, positions, batch_first, p);
  at::Tensor out = at::empty_symint(x.sym_sizes(), x.options());
  at::Tensor rng = at::empty({p > 0.0 ? 2 : 0}, x.options().dtype(at::kLong));
  return {out, rng};
}

at::Tensor add_position_backward_meta(const at::Tensor& grad, const at::Tensor& /*rng*/,
                                      double /*p*/) {
  return at::empty_symint(grad.sym_sizes(), grad.options());
}

at::Tensor sinusoidal_table_meta(const at::Tensor& positions, c10::SymInt d_model,
                                 double /*base*/, std::optional<at::ScalarType> dtype) {
  std::vector<c10::SymInt> shape(positions.sym_sizes().begin(), positions.sym_sizes().end());
  shape.push_back(d_model);
  return at::empty_symint(shape, positions.options().dtype(dtype.value_or(at::kFloat)));
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("add_position_forward", &add_position_forward_meta);
  m.impl("add_position_backward", &add_position_backward_meta);
  m.impl("sinusoidal_table", &sinusoidal_table_meta);
}

}  // namespace ops
}  // namespace posenc
