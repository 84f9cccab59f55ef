// Meta kernel of sinusoidal_table: the shape (positions..., d_model), float64, with symbolic
// sizes, after the same argument checks as the real kernels (when d_model is concrete).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "ops/add_position/add_position_checks.h"

namespace posenc {
namespace ops {
namespace {

at::Tensor sinusoidal_table_meta(const at::Tensor& positions, c10::SymInt d_model, double base) {
  if (const auto d = d_model.maybe_as_int()) check_sinusoidal_table_args(positions, *d, base);
  std::vector<c10::SymInt> shape(positions.sym_sizes().begin(), positions.sym_sizes().end());
  shape.push_back(d_model);
  return at::empty_symint(shape, positions.options().dtype(at::kDouble));
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) { m.impl("sinusoidal_table", &sinusoidal_table_meta); }

}  // namespace ops
}  // namespace posenc
