// posenc's functional C++ API. Every function calls its op through the dispatcher, so it
// runs on CPU or CUDA by the inputs' device and records gradients like any torch op.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace posenc {

// The fixed sinusoidal encoding at `positions` (any shape, integer or floating point):
// returns positions.shape + (d_model,), columns interleaved as
// PE(pos, 2i) = sin(pos * base^(-2i/d)), PE(pos, 2i+1) = cos(pos * base^(-2i/d)).
// Evaluated in double precision and rounded once to `dtype` (default float32).
at::Tensor sinusoidal_table(const at::Tensor& positions, int64_t d_model, double base = 10000.0,
                            std::optional<at::ScalarType> dtype = std::nullopt);

// dropout(x + table[positions], p), fused. x: (batch, seq, d) if batch_first, else
// (seq, batch, d); table: (max_len, d) or (1, max_len, d). Without positions, rows
// offset .. offset + seq - 1 are added; positions: int64 (seq,) or (batch, seq).
// Differentiable in x and table; the dropout mask is regenerated in backward.
at::Tensor add_position(const at::Tensor& x, const at::Tensor& table,
                        const std::optional<at::Tensor>& positions = std::nullopt,
                        int64_t offset = 0, bool batch_first = true, double p = 0.0);

}  // namespace posenc
