// posenc::rope_grid_positions: the coordinates of a grid of patches (image: (h, w); video:
// (t, h, w)) for multi-axis RoPE, after prefix tokens (class, registers) at the origin,
// which multi-axis RoPE leaves unrotated (angle 0 on every axis). Made of ATen ops
// (CompositeImplicitAutograd), so it runs on any device and traces under torch.compile.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace {

at::Tensor rope_grid_positions(at::IntArrayRef grid, int64_t num_prefix_tokens,
                               std::optional<at::Device> device) {
  TORCH_CHECK_VALUE(!grid.empty() && grid.size() <= static_cast<size_t>(math::kRopeMaxAxes),
                    "posenc: expected grid to have 1 to ", math::kRopeMaxAxes,
                    " sizes (one per axis), got ", grid);
  int64_t cells = 1;
  for (const int64_t g : grid) {
    TORCH_CHECK_VALUE(g > 0 && g <= (int64_t{1} << 40) / cells, "posenc: expected grid sizes to ",
                      "be positive with fewer than 2**40 cells in all, got grid=", grid);
    cells *= g;
  }
  TORCH_CHECK_VALUE(num_prefix_tokens >= 0 && num_prefix_tokens <= (int64_t{1} << 40),
                    "posenc: expected num_prefix_tokens >= 0, got ", num_prefix_tokens);
  const auto options = at::TensorOptions().dtype(at::kLong).device(device.value_or(at::kCPU));
  std::vector<at::Tensor> ranges;
  for (const int64_t g : grid) ranges.push_back(at::arange(g, options));
  std::vector<at::Tensor> coords;
  for (const at::Tensor& c : at::meshgrid(ranges, "ij")) coords.push_back(c.reshape({-1}));
  const int64_t axes = static_cast<int64_t>(grid.size());
  return at::cat({at::zeros({axes, num_prefix_tokens}, options), at::stack(coords)}, 1);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (len(grid), num_prefix_tokens + prod(grid)) int64: axis 0 the slowest-varying.
  m.def("rope_grid_positions(int[] grid, int num_prefix_tokens=0, Device? device=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(posenc, CompositeImplicitAutograd, m) {
  m.impl("rope_grid_positions", &rope_grid_positions);
}

}  // namespace ops
}  // namespace posenc
