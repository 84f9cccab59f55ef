// The helper ops in C++ (make_positions, sinusoidal_2d_table, resample_position_table,
// timestep_embedding) and diffusers' Timesteps module over timestep_embedding. Each function
// calls the posenc op of the same name through the dispatcher, as posenc.functional does from
// Python: one definition, the same checks and messages, the same bits in both languages.
// (rope_frequencies and rope_grid_positions, helper ops too, are in posenc/rope.h.)
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

namespace posenc {

// Padding-aware positions (fairseq): non-padding tokens of each row numbered
// padding_idx + offset + 1, padding_idx + offset + 2, ...; padding gets padding_idx.
// tokens: integer (batch, seq); padding_idx within +-2**62; offset in [0, 2**62] (the
// tokens already in a cache: transformers' past_key_values_length); the last position,
// padding_idx + offset + seq, must fit in int64. Op posenc::make_positions.
at::Tensor make_positions(const at::Tensor& tokens, int64_t padding_idx, int64_t offset = 0);

// MAE's fixed 2-D sin-cos table: (num_prefix_tokens + grid_h * grid_w, dim), zero prefix
// rows, patches in row-major order, first dim/2 columns encode w, last dim/2 encode h
// (frequencies 1 / base**(i / (dim/4)) in float64, converted to dtype by Tensor::to; dim a multiple
// of 4). Built on the host and moved to device. base_size and interpolation_scale give
// diffusers' rescaled coordinates (get_2d_sincos_pos_embed of PixArt / SD3): each axis of n
// patches at arange(n) / (n / base_size) / interpolation_scale, computed in float32 as
// diffusers does (no base_size: arange(n) / interpolation_scale). Op
// posenc::sinusoidal_2d_table.
at::Tensor sinusoidal_2d_table(int64_t grid_h, int64_t grid_w, int64_t dim, double base = 10000.0,
                               int64_t num_prefix_tokens = 0, at::ScalarType dtype = at::kFloat,
                               std::optional<at::Device> device = std::nullopt,
                               std::optional<double> base_size = std::nullopt,
                               double interpolation_scale = 1.0);

// Resizes a ViT table (1, prefix + H*W, d) to a new patch grid with interpolate (float32,
// cast back), keeping prefix rows; the old grid defaults to the square grid of the table
// (give both old_h and old_w, or neither). mode: "bicubic", "bilinear" or "nearest".
// Equal grids return a copy of pe. Op posenc::resample_position_table.
at::Tensor resample_position_table(const at::Tensor& pe, int64_t new_h, int64_t new_w,
                                   std::optional<int64_t> old_h = std::nullopt,
                                   std::optional<int64_t> old_w = std::nullopt,
                                   int64_t num_prefix_tokens = 1,
                                   const std::string& mode = "bicubic", bool antialias = true);

// Diffusion timestep embedding, diffusers' get_timestep_embedding: t 1-D (N timesteps),
// returns (N, dim) float32 [sin | cos] halves (swapped when flip_sin_to_cos), a zero column
// appended for an odd dim; the same float32 operations as diffusers, so the same numbers.
// ValueError where diffusers would divide 0 by 0 (dim / 2 == downscale_freq_shift).
// Op posenc::timestep_embedding.
at::Tensor timestep_embedding(const at::Tensor& t, int64_t dim, double max_period = 10000.0,
                              bool flip_sin_to_cos = false, double downscale_freq_shift = 1.0,
                              double scale = 1.0);

struct TimestepsOptions {
  // diffusers' Timesteps(num_channels, flip_sin_to_cos, downscale_freq_shift).
  TimestepsOptions(int64_t num_channels, bool flip_sin_to_cos, double downscale_freq_shift)
      : num_channels_(num_channels),
        flip_sin_to_cos_(flip_sin_to_cos),
        downscale_freq_shift_(downscale_freq_shift) {}
  // Width of the embedding (an odd width ends with a zero column).
  TORCH_ARG(int64_t, num_channels);
  // [cos | sin] halves when true, [sin | cos] when false.
  TORCH_ARG(bool, flip_sin_to_cos);
  // Frequencies exp(-ln(max_period) * i / (num_channels / 2 - downscale_freq_shift)).
  TORCH_ARG(double, downscale_freq_shift);
  // Factor applied to the angles.
  TORCH_ARG(double, scale) = 1.0;
  TORCH_ARG(double, max_period) = 10000.0;
};

// diffusers' Timesteps module: forward(t) is timestep_embedding(t, num_channels, max_period,
// flip_sin_to_cos, downscale_freq_shift, scale) (the function above: the same bits), (N,
// num_channels) float32 for a 1-D t of N timesteps. No parameters or buffers, as in
// diffusers; the options are checked (by the op) when the module is built.
class TimestepsImpl : public torch::nn::Cloneable<TimestepsImpl> {
 public:
  explicit TimestepsImpl(const TimestepsOptions& options);
  TimestepsImpl(int64_t num_channels, bool flip_sin_to_cos, double downscale_freq_shift)
      : TimestepsImpl(TimestepsOptions(num_channels, flip_sin_to_cos, downscale_freq_shift)) {}

  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  // torch::load: as RotaryPositionalEncodingImpl::load (no tensor; another module's refused).
  void load(torch::serialize::InputArchive& archive) override;

  torch::Tensor forward(const torch::Tensor& timesteps);

  TimestepsOptions options;
};

TORCH_MODULE(Timesteps);

}  // namespace posenc
