// sinusoidal_table composed from ATen ops, for backends without its kernel (the ATen
// fallback, aten_fallback.h): the frequencies of posenc/math/sinusoid.h on the host in
// float64, the angles pos * freq in float64 (float32 on MPS) and sin / cos with the
// device's functions, returned in float64 as the kernels' tables are.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "ops/add_position/add_position_checks.h"
#include "ops/common/aten_fallback.h"
#include "posenc/math/sinusoid.h"

namespace posenc {
namespace ops {
namespace {

at::Tensor sinusoidal_table_composite(const at::Tensor& positions, int64_t d_model, double base) {
  check_sinusoidal_table_args(positions, d_model, base);
  warn_aten_fallback("sinusoidal_table", positions.device());
  const double log_base = std::log(base);
  std::vector<double> freq(static_cast<size_t>(d_model));
  for (int64_t j = 0; j < d_model; ++j) freq[j] = math::sinusoid_inv_freq(j, d_model, log_base);
  const at::ScalarType wide = fallback_wide_dtype(positions.device());
  const at::Tensor angle = positions.to(wide).unsqueeze(-1) *
                           at::tensor(freq, at::kDouble).to(positions.device(), wide);
  const at::Tensor odd = at::arange(d_model, positions.options().dtype(at::kLong)).remainder(2).eq(1);
  return at::where(odd, at::cos(angle), at::sin(angle)).to(at::kDouble);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_composite);
}

}  // namespace ops
}  // namespace posenc
