// posenc::sinusoidal_2d_table: MAE's fixed 2-D sin-cos table (get_2d_sincos_pos_embed).
// The one definition behind posenc.functional.sinusoidal_2d_table (Python) and
// posenc::sinusoidal_2d_table (C++), so both give the same bits. Made of ATen ops
// (CompositeImplicitAutograd): it traces under torch.compile and builds Meta tables.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "ops/helpers/py_format.h"

namespace posenc {
namespace ops {
namespace {

// [sin | cos] halves of dim/2 frequencies at coords, in float64, with MAE's formula
// omega_i = 1 / base**(i / (dim/2)). (Of the two float64 forms, this one agrees with
// MAE's numpy table far more often than base**(-i / (dim/2)): the last bit of about one
// frequency in 200 against one in 3.)
at::Tensor sincos_halves(const at::Tensor& coords, int64_t dim, double base) {
  const at::Tensor exponent = at::arange(dim / 2, at::kDouble) / (dim / 2.0);
  const at::Tensor omega = at::reciprocal(at::pow(base, exponent));
  const at::Tensor angles = coords.reshape({-1, 1}) * omega;
  return at::cat({at::sin(angles), at::cos(angles)}, 1);
}

at::Tensor sinusoidal_2d_table(int64_t grid_h, int64_t grid_w, int64_t dim, double base,
                               int64_t num_prefix_tokens, std::optional<at::ScalarType> dtype,
                               std::optional<at::Device> device) {
  constexpr const char* kFn = "sinusoidal_2d_table: expected ";
  TORCH_CHECK_VALUE(grid_h > 0, kFn, "grid_h to be a positive integer, got ", grid_h);
  TORCH_CHECK_VALUE(grid_w > 0, kFn, "grid_w to be a positive integer, got ", grid_w);
  TORCH_CHECK_VALUE(dim > 0, kFn, "dim to be a positive integer, got ", dim);
  TORCH_CHECK_VALUE(dim % 4 == 0, kFn, "dim to be a multiple of 4, got ", dim);
  TORCH_CHECK_VALUE(num_prefix_tokens >= 0, kFn, "num_prefix_tokens >= 0, got ", num_prefix_tokens);
  // base <= 1 gives frequencies that do not decrease (base 1: identical columns), as in
  // sinusoidal_table and RoPE.
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 1.0, kFn, "base to be a finite number > 1, got ",
                    py_float(base));
  const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(at::isFloatingType(out_dtype), kFn, "a floating-point dtype, got ",
                   py_dtype(out_dtype));
  int64_t cells = 0, rows = 0, elements = 0;
  const bool overflows = c10::mul_overflows(grid_h, grid_w, &cells) ||
                         c10::add_overflows(cells, num_prefix_tokens, &rows) ||
                         c10::mul_overflows(rows, dim, &elements);
  TORCH_CHECK_VALUE(!overflows, kFn, "num_prefix_tokens + grid_h * grid_w rows of dim columns to ",
                    "fit in int64, got ", num_prefix_tokens, " + ", grid_h, " * ", grid_w,
                    " rows of ", dim);
  // Built on the host in float64 and rounded once, so every device gets the same bits.
  const at::Tensor h = at::arange(grid_h, at::kDouble).repeat_interleave(grid_w);
  const at::Tensor w = at::arange(grid_w, at::kDouble).repeat({grid_h});
  // First half of the columns encodes the patch column w, the second half its row h.
  const at::Tensor table =
      at::cat({at::zeros({num_prefix_tokens, dim}, at::kDouble),
               at::cat({sincos_halves(w, dim / 2, base), sincos_halves(h, dim / 2, base)}, 1)},
              0);
  return table.to(out_dtype).to(device.value_or(at::kCPU));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (num_prefix_tokens + grid_h * grid_w, dim): zero rows for the prefix (class) tokens,
  // then the patches in row-major (h, w) order; dtype float32 unless given.
  m.def(
      "sinusoidal_2d_table(int grid_h, int grid_w, int dim, float base=10000.0, "
      "int num_prefix_tokens=0, ScalarType? dtype=None, Device? device=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(posenc, CompositeImplicitAutograd, m) {
  m.impl("sinusoidal_2d_table", &sinusoidal_2d_table);
}

}  // namespace ops
}  // namespace posenc
