// posenc::resample_position_table: a ViT position table resized to another patch grid, as
// timm's resample_abs_pos_embed does (float32 interpolation, prefix rows kept). The one
// definition behind posenc.functional.resample_position_table (Python) and
// posenc::resample_position_table (C++). Made of ATen ops (CompositeImplicitAutograd), so
// it is differentiable, runs on any device and traces under torch.compile.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "ops/common/py_format.h"

namespace posenc {
namespace ops {
namespace {

constexpr const char* kFn = "resample_position_table: expected ";

// (h, w), both positive; name is new_grid or old_grid.
std::vector<int64_t> checked_grid(const char* name, at::IntArrayRef grid) {
  TORCH_CHECK_VALUE(grid.size() == 2, kFn, name, " to be (h, w) of ints, got ", py_tuple(grid));
  TORCH_CHECK_VALUE(grid[0] > 0 && grid[1] > 0, kFn, name, " to be positive, got ", py_tuple(grid));
  int64_t cells = 0;
  TORCH_CHECK_VALUE(!c10::mul_overflows(grid[0], grid[1], &cells), kFn, name,
                    " to have an int64 number of cells, got ", py_tuple(grid));
  return grid.vec();
}

// The largest side with side * side <= n (exact for every int64 n >= 0).
int64_t isqrt(int64_t n) {
  auto side = static_cast<int64_t>(std::sqrt(static_cast<double>(n)));
  while (side > 0 && side > n / side) --side;
  while ((side + 1) <= n / (side + 1)) ++side;
  return side;
}

at::Tensor resample_position_table(const at::Tensor& pe, at::IntArrayRef new_grid,
                                   at::OptionalIntArrayRef old_grid, int64_t num_prefix_tokens,
                                   c10::string_view mode, bool antialias) {
  const bool bicubic = mode == "bicubic", bilinear = mode == "bilinear";
  TORCH_CHECK_VALUE(bicubic || bilinear || mode == "nearest", kFn,
                    "mode bicubic, bilinear or nearest, got ", py_str(mode));
  TORCH_CHECK_VALUE(pe.dim() == 3 && pe.size(0) == 1, kFn, "pe of shape (1, tokens, dim), got ",
                    py_tuple(pe.sizes()));
  // An integer table would be interpolated and truncated back (a learned table is floating).
  TORCH_CHECK_TYPE(at::isFloatingType(pe.scalar_type()), kFn, "pe to be a floating-point table, got ",
                   py_dtype(pe.scalar_type()));
  const std::vector<int64_t> new_hw = checked_grid("new_grid", new_grid);
  const int64_t tokens = pe.size(1);
  TORCH_CHECK_VALUE(num_prefix_tokens >= 0 && num_prefix_tokens < tokens, kFn,
                    "0 <= num_prefix_tokens < ", tokens, " (at least one patch row), got ", num_prefix_tokens);
  TORCH_CHECK_VALUE(pe.size(2) > 0, kFn, "pe of shape (1, tokens, dim) with dim > 0, got ", py_tuple(pe.sizes()));
  const int64_t patches = tokens - num_prefix_tokens;
  std::vector<int64_t> old_hw;
  if (old_grid.has_value()) {
    old_hw = checked_grid("old_grid", *old_grid);
    TORCH_CHECK_VALUE(old_hw[0] * old_hw[1] == patches, "resample_position_table: old_grid ",
                      py_tuple(old_hw), " has ", old_hw[0] * old_hw[1], " cells but the table has ",
                      patches, " patch rows after ", num_prefix_tokens, " prefix tokens");
  } else {
    const int64_t side = isqrt(patches);
    TORCH_CHECK_VALUE(side * side == patches, "resample_position_table: ", patches,
                      " patch rows (after ", num_prefix_tokens, " prefix tokens) are not a ",
                      "square grid; pass old_grid=(h, w)");
    old_hw = {side, side};
  }
  // Equal grids: the table as it is (a copy: the op's result never aliases pe).
  if (old_hw == new_hw) return pe.clone();
  const int64_t dim = pe.size(2);
  const at::Tensor prefix = pe.narrow(1, 0, num_prefix_tokens);
  const at::Tensor image = pe.narrow(1, num_prefix_tokens, patches)
                               .to(at::kFloat)
                               .reshape({1, old_hw[0], old_hw[1], dim})
                               .permute({0, 3, 1, 2});
  // The kernels F.interpolate(size=new_grid, align_corners=False) calls for each mode.
  at::Tensor out;
  if (bicubic) {
    out = antialias ? at::_upsample_bicubic2d_aa(image, new_hw, false)
                    : at::upsample_bicubic2d(image, new_hw, false);
  } else if (bilinear) {
    out = antialias ? at::_upsample_bilinear2d_aa(image, new_hw, false)
                    : at::upsample_bilinear2d(image, new_hw, false);
  } else {
    out = at::upsample_nearest2d(image, new_hw);  // antialias does not apply
  }
  const at::Tensor grid = out.permute({0, 2, 3, 1}).reshape({1, -1, dim}).to(pe.scalar_type());
  return at::cat({prefix, grid}, 1);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (1, num_prefix_tokens + new_h * new_w, dim) from pe (1, num_prefix_tokens + H * W, dim);
  // old_grid defaults to the square grid the table implies. mode: bicubic, bilinear, nearest.
  m.def(
      "resample_position_table(Tensor pe, int[] new_grid, int[]? old_grid=None, "
      "int num_prefix_tokens=1, str mode=\"bicubic\", bool antialias=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(posenc, CompositeImplicitAutograd, m) {
  m.impl("resample_position_table", &resample_position_table);
}

// Under vmap the same composite, its ATen ops batched (as ATen's own composites are): without
// this, functorch's per-sample fallback ran it once per sample, with its warning.
TORCH_LIBRARY_IMPL(posenc, FuncTorchBatchedDecomposition, m) {
  m.impl("resample_position_table", &resample_position_table);
}

}  // namespace ops
}  // namespace posenc
