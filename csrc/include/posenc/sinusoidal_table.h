// The fixed sinusoidal encoding table, for LibTorch applications: posenc::sinusoidal_table
// calls the op of the same name through the dispatcher (as posenc.functional.sinusoidal_table
// does from Python), so it runs on CPU or CUDA by the positions' device and records gradients
// (of floating-point positions) like any torch op.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace posenc {

// The fixed sinusoidal encoding at `positions` (any shape, integer or floating point):
// returns positions.shape + (d_model,), columns interleaved as
// PE(pos, 2i) = sin(pos * base^(-2i/d)), PE(pos, 2i+1) = cos(pos * base^(-2i/d)).
// Evaluated in double precision and converted to `dtype` (default float32) as Tensor::to
// converts: once to float32, through float32 to float16 and bfloat16.
at::Tensor sinusoidal_table(const at::Tensor& positions, int64_t d_model, double base = 10000.0,
                            std::optional<at::ScalarType> dtype = std::nullopt);

}  // namespace posenc
