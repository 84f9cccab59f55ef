// posenc/functional.h: composite helpers (no kernels of their own), mirroring
// python/posenc/functional.py.
#include "posenc/functional.h"

#include <c10/util/Exception.h>
#include <torch/nn/functional/upsampling.h>

#include <cmath>

namespace posenc {

namespace {

// [sin | cos] halves of dim/2 frequencies base^(-i/(dim/2)) at coords, in float64.
at::Tensor sincos_halves(const at::Tensor& coords, int64_t dim, double base) {
  const at::Tensor exponent = at::arange(dim / 2, at::kDouble) / (dim / 2.0);
  const at::Tensor omega = at::pow(base, -exponent);
  const at::Tensor angles = coords.reshape({-1, 1}).to(at::kDouble) * omega;
  return at::cat({at::sin(angles), at::cos(angles)}, 1);
}

}  // namespace

at::Tensor make_positions(const at::Tensor& tokens, int64_t padding_idx) {
  TORCH_CHECK_VALUE(tokens.dim() == 2 && !tokens.is_floating_point() && !tokens.is_complex(),
                    "make_positions: expected integer tokens of shape (batch, seq), got ",
                    tokens.scalar_type(), " of shape ", tokens.sizes());
  constexpr int64_t kLimit = int64_t{1} << 62;  // padding_idx + seq must stay an int64
  TORCH_CHECK_VALUE(padding_idx >= -kLimit && padding_idx <= kLimit,
                    "make_positions: expected padding_idx within +-2**62, got ", padding_idx);
  const at::Tensor mask = tokens.ne(padding_idx).to(at::kLong);
  return at::cumsum(mask, 1) * mask + padding_idx;
}

at::Tensor sinusoidal_2d_table(int64_t grid_h, int64_t grid_w, int64_t dim, double base,
                               int64_t num_prefix_tokens, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(grid_h > 0 && grid_w > 0, "sinusoidal_2d_table: expected a positive grid, got (",
                    grid_h, ", ", grid_w, ")");
  TORCH_CHECK_VALUE(dim > 0 && dim % 4 == 0,
                    "sinusoidal_2d_table: expected dim to be a multiple of 4, got ", dim);
  TORCH_CHECK_VALUE(num_prefix_tokens >= 0,
                    "sinusoidal_2d_table: expected num_prefix_tokens >= 0, got ", num_prefix_tokens);
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 1.0,
                    "sinusoidal_2d_table: expected base to be a finite number > 1, got ", base);
  TORCH_CHECK_TYPE(at::isFloatingType(dtype),
                    "sinusoidal_2d_table: expected a floating-point dtype, got ", dtype);
  const at::Tensor rows = at::arange(grid_h, at::kDouble).repeat_interleave(grid_w);
  const at::Tensor cols = at::arange(grid_w, at::kDouble).repeat({grid_h});
  const at::Tensor table =
      at::cat({sincos_halves(cols, dim / 2, base), sincos_halves(rows, dim / 2, base)}, 1);
  return at::cat({at::zeros({num_prefix_tokens, dim}, at::kDouble), table}, 0).to(dtype);
}

at::Tensor resample_position_table(const at::Tensor& pe, int64_t new_h, int64_t new_w,
                                   std::optional<int64_t> old_h, std::optional<int64_t> old_w,
                                   int64_t num_prefix_tokens, const std::string& mode,
                                   bool antialias) {
  TORCH_CHECK_VALUE(pe.dim() == 3 && pe.size(0) == 1,
                    "resample_position_table: expected pe of shape (1, tokens, dim), got ",
                    pe.sizes());
  TORCH_CHECK_VALUE(new_h > 0 && new_w > 0, "resample_position_table: expected a positive new grid, got (",
                    new_h, ", ", new_w, ")");
  TORCH_CHECK_VALUE(num_prefix_tokens >= 0 && num_prefix_tokens <= pe.size(1),
                    "resample_position_table: expected 0 <= num_prefix_tokens <= ", pe.size(1),
                    ", got ", num_prefix_tokens);
  const int64_t patches = pe.size(1) - num_prefix_tokens;
  if (!old_h.has_value() || !old_w.has_value()) {
    const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(patches))));
    TORCH_CHECK_VALUE(side * side == patches, "resample_position_table: ", patches,
                      " patch rows are not a square grid; pass the old grid");
    old_h = side;
    old_w = side;
  }
  TORCH_CHECK_VALUE(*old_h * *old_w == patches, "resample_position_table: old grid (", *old_h, ", ",
                    *old_w, ") has ", *old_h * *old_w, " cells but the table has ", patches,
                    " patch rows after ", num_prefix_tokens, " prefix tokens");
  if (*old_h == new_h && *old_w == new_w) return pe;
  namespace F = torch::nn::functional;
  const int64_t dim = pe.size(2);
  const at::Tensor prefix = pe.narrow(1, 0, num_prefix_tokens);
  at::Tensor grid = pe.narrow(1, num_prefix_tokens, patches)
                        .to(at::kFloat)
                        .reshape({1, *old_h, *old_w, dim})
                        .permute({0, 3, 1, 2});
  auto options = F::InterpolateFuncOptions().size(std::vector<int64_t>{new_h, new_w});
  if (mode == "bicubic") {
    options = options.mode(torch::kBicubic).align_corners(false).antialias(antialias);
  } else if (mode == "bilinear") {
    options = options.mode(torch::kBilinear).align_corners(false).antialias(antialias);
  } else if (mode == "nearest") {
    options = options.mode(torch::kNearest);
  } else {
    TORCH_CHECK_VALUE(false, "resample_position_table: expected mode bicubic, bilinear or nearest, got ",
                      mode);
  }
  grid = F::interpolate(grid, options).permute({0, 2, 3, 1}).reshape({1, -1, dim}).to(pe.scalar_type());
  return at::cat({prefix, grid}, 1);
}

}  // namespace posenc
