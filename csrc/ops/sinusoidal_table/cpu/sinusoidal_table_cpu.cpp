// CPU kernel of sinusoidal_table: every entry evaluated in double precision by the shared
// header and stored as it is (float64: the front ends round it once to the dtype asked for).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "ops/add_position/add_position_checks.h"
#include "posenc/math/sinusoid.h"

namespace posenc {
namespace ops {
namespace {

at::Tensor sinusoidal_table_cpu(const at::Tensor& positions, int64_t d_model, double base) {
  check_sinusoidal_table_args(positions, d_model, base);
  const at::Tensor pos = positions.to(at::kDouble).contiguous();
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(d_model);
  at::Tensor out = at::empty(shape, positions.options().dtype(at::kDouble));
  const int64_t rows = pos.numel();
  if (rows == 0) return out;
  const double log_base = std::log(base);
  const double* p = pos.const_data_ptr<double>();
  double* o = out.mutable_data_ptr<double>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d_model), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t j = 0; j < d_model; ++j) {
        o[r * d_model + j] = math::sinusoid_value(p[r], j, d_model, log_base);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_cpu);
}

}  // namespace ops
}  // namespace posenc
