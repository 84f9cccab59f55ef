// posenc's LibTorch modules (torch::nn style: Options + Impl + TORCH_MODULE holder).
#pragma once

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <ostream>

namespace posenc {

struct PositionalEncodingOptions {
  /* implicit */ PositionalEncodingOptions(int64_t d_model) : d_model_(d_model) {}
  // Width of the embeddings the encoding is added to.
  TORCH_ARG(int64_t, d_model);
  // Dropout probability applied after the addition, in training mode only.
  TORCH_ARG(double, dropout) = 0.1;
  // Number of positions in the table `pe`.
  TORCH_ARG(int64_t, max_len) = 5000;
  // x is (batch, seq, d_model) when true, (seq, batch, d_model) when false.
  TORCH_ARG(bool, batch_first) = true;
  // Wavelength base of the sinusoids.
  TORCH_ARG(double, base) = 10000.0;
  // Check CUDA position values against max_len before the kernel (one device sync).
  // CPU positions are always checked; unchecked CUDA positions out of range give NaN rows.
  TORCH_ARG(bool, check_positions) = true;
};

// The fixed sinusoidal encoding of Vaswani et al. with fused dropout. Holds the buffer
// `pe` of shape (1, max_len, d_model) in float32, like the classic Python class.
class PositionalEncodingImpl : public torch::nn::Cloneable<PositionalEncodingImpl> {
 public:
  explicit PositionalEncodingImpl(const PositionalEncodingOptions& options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  // dropout(x + pe[offset : offset + seq]).
  torch::Tensor forward(const torch::Tensor& x, int64_t offset = 0);
  // dropout(x + pe[positions]); positions: int64 (seq,) or (batch, seq).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions);

  PositionalEncodingOptions options;
  torch::Tensor pe;
};

TORCH_MODULE(PositionalEncoding);

}  // namespace posenc
