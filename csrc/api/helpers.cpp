// posenc/helpers.h: the C++ entry points of the helper ops (ops/helpers/*.cpp), called
// through the dispatcher like posenc.functional in Python, so both get the same checks,
// messages and bits; and posenc::Timesteps, diffusers' Timesteps module over the
// timestep_embedding op, the one definition behind posenc.Timesteps (Python) too.
#include "posenc/helpers.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <ostream>
#include <vector>

#include "module_state.h"
#include "ops/common/op_handles.h"

namespace posenc {

at::Tensor make_positions(const at::Tensor& tokens, int64_t padding_idx, int64_t offset) {
  return ops::make_positions_op().call(tokens, padding_idx, offset);
}

at::Tensor sinusoidal_2d_table(int64_t grid_h, int64_t grid_w, int64_t dim, double base,
                               int64_t num_prefix_tokens, at::ScalarType dtype,
                               std::optional<at::Device> device, std::optional<double> base_size,
                               double interpolation_scale) {
  return ops::sinusoidal_2d_table_op().call(grid_h, grid_w, dim, base, num_prefix_tokens, dtype,
                                            device, base_size, interpolation_scale);
}

at::Tensor resample_position_table(const at::Tensor& pe, int64_t new_h, int64_t new_w,
                                   std::optional<int64_t> old_h, std::optional<int64_t> old_w,
                                   int64_t num_prefix_tokens, const std::string& mode,
                                   bool antialias) {
  TORCH_CHECK_VALUE(old_h.has_value() == old_w.has_value(),
                    "resample_position_table: expected both old_h and old_w or neither, got ",
                    old_h.has_value() ? "old_h only" : "old_w only");
  const std::vector<int64_t> new_grid{new_h, new_w};
  std::vector<int64_t> old_grid;
  if (old_h.has_value()) old_grid = {*old_h, *old_w};
  const at::OptionalIntArrayRef old =
      old_h.has_value() ? at::OptionalIntArrayRef(old_grid) : at::OptionalIntArrayRef();
  return ops::resample_position_table_op().call(pe, new_grid, old, num_prefix_tokens, mode,
                                                antialias);
}

at::Tensor timestep_embedding(const at::Tensor& t, int64_t dim, double max_period,
                              bool flip_sin_to_cos, double downscale_freq_shift, double scale) {
  return ops::timestep_embedding_op().call(t, dim, max_period, flip_sin_to_cos,
                                           downscale_freq_shift, scale);
}

// ---- Timesteps

TimestepsImpl::TimestepsImpl(const TimestepsOptions& options_) : options(options_) { reset(); }

void TimestepsImpl::reset() {
  // The op checks the settings (with its messages): on no timesteps, so that bad options
  // fail here rather than at the first forward.
  forward(torch::empty({0}));
}

void TimestepsImpl::load(torch::serialize::InputArchive& archive) { detail::load_same_shapes(*this, archive); }

void TimestepsImpl::pretty_print(std::ostream& stream) const {
  stream << "posenc::Timesteps(num_channels=" << options.num_channels()
         << ", flip_sin_to_cos=" << (options.flip_sin_to_cos() ? "true" : "false")
         << ", downscale_freq_shift=" << options.downscale_freq_shift()
         << ", scale=" << options.scale() << ", max_period=" << options.max_period() << ")";
}

torch::Tensor TimestepsImpl::forward(const torch::Tensor& timesteps) {
  return timestep_embedding(timesteps, options.num_channels(), options.max_period(),
                            options.flip_sin_to_cos(), options.downscale_freq_shift(),
                            options.scale());
}

}  // namespace posenc
