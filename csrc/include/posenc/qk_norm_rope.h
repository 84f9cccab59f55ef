// Fused QK-norm + RoPE (Qwen3, Gemma 3, OLMo 2): RMSNorm of q and k, scaled by
// weight + weight_offset, then RoPE exactly as apply_rope with the same options; one op
// (posenc::qk_norm_rope) with a fused backward (gradients of q, k and both weights).
#pragma once

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

}  // namespace posenc
