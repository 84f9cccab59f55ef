// Helpers around the encodings, in C++ (the same behaviour as posenc.functional in Python).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

namespace posenc {

// Padding-aware positions (fairseq): non-padding tokens of each row numbered
// padding_idx + 1, padding_idx + 2, ...; padding gets padding_idx. tokens: (batch, seq).
at::Tensor make_positions(const at::Tensor& tokens, int64_t padding_idx);

// MAE's fixed 2-D sin-cos table: (num_prefix_tokens + grid_h * grid_w, dim), zero prefix
// rows, patches in row-major order, first dim/2 columns encode w, last dim/2 encode h.
at::Tensor sinusoidal_2d_table(int64_t grid_h, int64_t grid_w, int64_t dim, double base = 10000.0,
                               int64_t num_prefix_tokens = 0,
                               at::ScalarType dtype = at::kFloat);

// Resizes a ViT table (1, prefix + H*W, d) to a new patch grid with interpolate (float32,
// cast back), keeping prefix rows; old grid defaults to the square grid of the table.
at::Tensor resample_position_table(const at::Tensor& pe, int64_t new_h, int64_t new_w,
                                   std::optional<int64_t> old_h = std::nullopt,
                                   std::optional<int64_t> old_w = std::nullopt,
                                   int64_t num_prefix_tokens = 1,
                                   const std::string& mode = "bicubic", bool antialias = true);

}  // namespace posenc
