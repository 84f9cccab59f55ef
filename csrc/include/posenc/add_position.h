// The add_position family's C++ API, for LibTorch applications: posenc::add_position (the
// fused dropout(x + table[positions]) op through the dispatcher, as
// posenc.functional.add_position from Python) and the modules built on it,
// PositionalEncoding (the fixed sinusoidal table) and LearnedPositionalEncoding (a trained
// table), torch::nn style: Options + Impl + TORCH_MODULE holder.
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_module_holder.h>
#include <torch/nn/modules/container/any_value.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <ostream>

namespace posenc {

// dropout(x + table[positions], p), fused. x: (batch, seq, d) if batch_first, else
// (seq, batch, d); table: (max_len, d) or (1, max_len, d). Without positions, rows
// offset .. offset + seq - 1 are added; positions: int64 (seq,), (1, seq) or (batch, seq).
// Differentiable in x and table; backward uses the forward's dropout mask (saved as bits on the
// CPU, regenerated from its Philox (seed, offset) on CUDA).
at::Tensor add_position(const at::Tensor& x, const at::Tensor& table,
                        const std::optional<at::Tensor>& positions = std::nullopt,
                        int64_t offset = 0, bool batch_first = true, double p = 0.0);

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
  // CPU positions are always checked; unchecked CUDA positions out of range stop the kernel
  // with a device-side assert (an error at the next synchronisation).
  TORCH_ARG(bool, check_positions) = true;
};

// The fixed sinusoidal encoding of Vaswani et al. with fused dropout. Holds the buffer
// `pe` of shape (1, max_len, d_model) in float32, like the classic Python class.
class PositionalEncodingImpl : public torch::nn::Cloneable<PositionalEncodingImpl> {
 public:
  explicit PositionalEncodingImpl(const PositionalEncodingOptions& options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  // torch::load: refuses an archive whose `pe` has another shape (other max_len or d_model),
  // as Python's load_state_dict does, leaving the module as it was.
  void load(torch::serialize::InputArchive& archive) override;

  // dropout(x + pe[offset : offset + seq]), or dropout(x + pe[positions]) when positions
  // (int64, (seq,), (1, seq) or (batch, seq)) are given. One signature, as in Python, so that the
  // TORCH_MODULE holder's operator() works: pe(x), pe(x, 128), pe(x, 0, positions).
  torch::Tensor forward(const torch::Tensor& x, int64_t offset = 0,
                        const std::optional<torch::Tensor>& positions = std::nullopt);

  PositionalEncodingOptions options;
  torch::Tensor pe;

 protected:
  // The defaults for torch::nn::AnyModule / Sequential, which call forward(x).
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(int64_t{0})},
                           {2, torch::nn::AnyValue(std::optional<torch::Tensor>())})
};

TORCH_MODULE(PositionalEncoding);

struct LearnedPositionalEncodingOptions {
  /* implicit */ LearnedPositionalEncodingOptions(int64_t d_model) : d_model_(d_model) {}
  TORCH_ARG(int64_t, d_model);
  TORCH_ARG(double, dropout) = 0.1;
  TORCH_ARG(int64_t, max_len) = 5000;
  TORCH_ARG(bool, batch_first) = true;
  // Std of the truncated-normal initialisation (cut at +-2 std), the BERT/ViT convention.
  TORCH_ARG(double, init_std) = 0.02;
  TORCH_ARG(bool, check_positions) = true;
  // torch::nn::Embedding's: the row is zeroed by reset_parameters() and gets no gradient
  // (fairseq, RoBERTa, XLM-R; make_positions puts padding tokens there). Negative: from the end.
  // Read at each call (set later, the row keeps its values and gets no gradient from then on).
  TORCH_ARG(std::optional<int64_t>, padding_idx) = std::nullopt;
};

// Learned absolute position embeddings (BERT, GPT-2, ViT) with fused dropout: the
// trainable parameter `pe` of shape (1, max_len, d_model). Its gradient is the batch sum
// of the gradient reaching x, computed deterministically.
class LearnedPositionalEncodingImpl
    : public torch::nn::Cloneable<LearnedPositionalEncodingImpl> {
 public:
  explicit LearnedPositionalEncodingImpl(const LearnedPositionalEncodingOptions& options);

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  // As PositionalEncodingImpl::load.
  void load(torch::serialize::InputArchive& archive) override;

  // As PositionalEncodingImpl::forward.
  torch::Tensor forward(const torch::Tensor& x, int64_t offset = 0,
                        const std::optional<torch::Tensor>& positions = std::nullopt);

  // Copies a (max_len, d_model) table (BERT/GPT-2 style) or a (1, max_len, d_model) one
  // (ViT pos_embed) into `pe`.
  void load_table(const torch::Tensor& table);

  LearnedPositionalEncodingOptions options;
  torch::Tensor pe;

 private:
  // options.padding_idx as a row of a table of `rows` rows (negative ones counted from the
  // end), checked; read at each call, as Python's module reads its padding_idx.
  std::optional<int64_t> padding_row(int64_t rows) const;

 protected:
  // The defaults for torch::nn::AnyModule / Sequential, which call forward(x).
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(int64_t{0})},
                           {2, torch::nn::AnyValue(std::optional<torch::Tensor>())})
};

TORCH_MODULE(LearnedPositionalEncoding);

}  // namespace posenc
