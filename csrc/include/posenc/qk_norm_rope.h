// Fused QK-norm + RoPE (Qwen3, Gemma 3, OLMo 2): RMSNorm of q and k, scaled by
// weight + weight_offset, then RoPE exactly as apply_rope with the same options; one op
// (posenc::qk_norm_rope) with a fused backward (gradients of q, k and both weights).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <string>
#include <tuple>

#include "posenc/rope.h"

namespace posenc {

struct QkNormRopeOptions {
  // Added to the mean square before the inverse square root.
  TORCH_ARG(double, eps) = 1e-6;
  // Added to the weights: 1.0 for Gemma 3's (1 + w).
  TORCH_ARG(double, weight_offset) = 0.0;
  // "head": each head's vector, weights (head_dim,) (Qwen3, Gemma 3); "hidden": each token's
  // whole q (resp. k) projection, weights (heads * head_dim,) (OLMo 2).
  TORCH_ARG(std::string, norm) = "head";
  // Every RoPE option, as apply_rope takes them.
  TORCH_ARG(ApplyRopeOptions, rope) = {};
};

// (q, k) normalised and rotated; the norm in float32 (float64 for float64 inputs), outputs
// in q's dtype. Weights of q's dtype (or float32 for float16 / bfloat16 q).
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(const torch::Tensor& q, const torch::Tensor& k,
                                                      const torch::Tensor& q_weight,
                                                      const torch::Tensor& k_weight,
                                                      const QkNormRopeOptions& options = {});

// In place (inference): q and k normalised and rotated in their own storage (no autograd;
// q and k must not share memory, nor the weights with them).
void qk_norm_rope_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                   const torch::Tensor& k_weight, const QkNormRopeOptions& options = {});

// One RMSNorm's weight, as Hugging Face's q_norm / k_norm submodules hold it (parameter
// "weight"), so that QKNormRotary's state_dict keys are theirs: q_norm.weight, k_norm.weight.
class QkNormWeightImpl : public torch::nn::Cloneable<QkNormWeightImpl> {
 public:
  QkNormWeightImpl(int64_t size, double init) : size(size), init(init) { reset(); }
  // Registers `weight` (size values of init, in the default dtype as Python's module), or on
  // a second call sets it back to init (keeping its dtype and device).
  void reset() override;
  // torch::load: refuses a weight of another size (as PositionalEncodingImpl::load).
  void load(torch::serialize::InputArchive& archive) override;
  void pretty_print(std::ostream& stream) const override;
  int64_t size;
  double init;
  torch::Tensor weight;
};
TORCH_MODULE(QkNormWeight);

struct QKNormRotaryOptions {
  /* implicit */ QKNormRotaryOptions(int64_t head_dim) : head_dim_(head_dim) {}
  // Features per head.
  TORCH_ARG(int64_t, head_dim);
  TORCH_ARG(double, eps) = 1e-6;
  // 1.0 for Gemma 3's (1 + w); the weights then start at 0 (effective weights start at 1).
  TORCH_ARG(double, weight_offset) = 0.0;
  // "head" (Qwen3, Gemma 3) or "hidden" (OLMo 2: then num_heads and num_kv_heads size the
  // weights, heads * head_dim values each).
  TORCH_ARG(std::string, norm) = "head";
  TORCH_ARG(std::optional<int64_t>, num_heads) = std::nullopt;
  TORCH_ARG(std::optional<int64_t>, num_kv_heads) = std::nullopt;
  // RoPE's settings (base, interleaved, rotary_dim, scaling, layout, sections); positions,
  // offsets and cu_seqlens come with each call (RopePositions).
  TORCH_ARG(ApplyRopeOptions, rope) = {};
};

// Fused QK-norm + RoPE as a module owning the two norm weights (the twin of Python's
// posenc.QKNormRotary): forward(q, k, where) = qk_norm_rope(q, k, q_norm->weight,
// k_norm->weight, options with where's positions).
namespace detail {
struct ParsedQkNormRope;  // the options as the op reads them (api/qk_norm_rope.cpp)
}  // namespace detail

// reset() (run by the constructor) parses and checks the options once, into the call every
// forward starts from, except eps, weight_offset and norm, which forward reads (and the op
// checks) at each call, as Python's module does: after changing another of `options`, call
// reset() (it keeps the norm weights,
// trained or not, unless their size changes). options.rope() holds the configuration only:
// positions come with each call (RopePositions); set there, reset() raises a ValueError.
// clone() runs reset() on the copy (LibTorch's Cloneable): a clone parses the options as
// they are now, and copies the weights.
class QKNormRotaryImpl : public torch::nn::Cloneable<QKNormRotaryImpl> {
 public:
  explicit QKNormRotaryImpl(const QKNormRotaryOptions& options);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  // torch::load: refuses norm weights of other sizes, leaving both as they were.
  void load(torch::serialize::InputArchive& archive) override;
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& q, const torch::Tensor& k,
                                                   const RopePositions& where = {});

  QKNormRotaryOptions options;
  QkNormWeight q_norm{nullptr};
  QkNormWeight k_norm{nullptr};

 protected:
  // The default for torch::nn::AnyModule, which calls forward(q, k).
  FORWARD_HAS_DEFAULT_ARGS({2, torch::nn::AnyValue(RopePositions())})

 private:
  // Set by reset(); immutable, so clones share it.
  std::shared_ptr<const detail::ParsedQkNormRope> parsed_;
};
TORCH_MODULE(QKNormRotary);

}  // namespace posenc
