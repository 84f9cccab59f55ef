// What a qk_norm_rope kernel needs, as plain data: the RoPE call's parameters (RopeArgs: q
// and k as (batch, seq, heads, head_dim), positions, frequencies) plus the norm's. Passed
// by value to the CUDA kernels as RopeArgs is, so CPU and CUDA read identical inputs.
#pragma once

#include <cstdint>

#include "ops/common/rope_args.h"

namespace posenc {
namespace ops {

enum class QkNorm : int { kHead = 0, kHidden = 1 };

struct QkNormRopeArgs {
  // q and k: in = the inputs x, out = the outputs (forward) or dx (backward). rope.inverse
  // is the direction the kernel turns: the call's in the forward, the opposite in the
  // backward (the incoming gradient is turned back).
  RopeArgs rope;
  // Backward: the incoming gradients of q and k (in only), same views as rope.q / rope.k.
  RopeOperand grad_q, grad_k;
  // The effective weights (weight + weight_offset) in the compute type (float, double for
  // float64 inputs), contiguous: head_dim values (norm "head") or heads * head_dim ("hidden").
  const void* q_weight = nullptr;
  const void* k_weight = nullptr;
  // Backward: where the weight gradients go, compute type (backend-specific layout: the
  // CPU's per-chunk partial sums, the CUDA kernel's per-block ones).
  void* q_weight_grad = nullptr;
  void* k_weight_grad = nullptr;
  double eps = 1e-6;
  QkNorm norm = QkNorm::kHead;
};

}  // namespace ops
}  // namespace posenc
