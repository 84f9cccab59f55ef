// CPU kernels of qk_norm_rope, compiled in the vector-ISA translation unit
// cpu/kernel.cpp once per capability (CMakeLists.txt); callers go through
// qk_norm_rope_stub (cpu_capability.h). Plain data only (no ATen): QkNormRopeArgs is also
// what the CUDA kernels take (cuda/qk_norm_rope/qk_norm_rope.cu, through its launch.h).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "ops/common/cpu/cpu_capability.h"
#include "ops/common/rope_args.h"

namespace posenc {
namespace ops {

// What a qk_norm_rope kernel needs, as plain data: the RoPE call's parameters (RopeArgs: q
// and k as (batch, seq, heads, head_dim), positions, frequencies) plus the norm's. Passed
// by value to the CUDA kernels as RopeArgs is, so CPU and CUDA read identical inputs.
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

namespace cpu {

// The backward's weight gradients are summed per chunk of tokens (chunks of a fixed split
// of the tokens, whatever the thread count: deterministic), then over the chunks in order.
constexpr int64_t kQkNormMaxChunks = 64;
inline int64_t qk_norm_chunks(int64_t tokens) {
  return tokens < kQkNormMaxChunks ? tokens : kQkNormMaxChunks;
}

// Forward: a.rope.q.out / a.rope.k.out from the inputs. Backward: dx into the outs, and the
// weight gradients into a.q_weight_grad / a.k_weight_grad: (chunks, weight length) zeroed
// buffers of the compute type, whose row 0 holds the sums on return.
using QkNormRopeFn = void (*)(const QkNormRopeArgs& a, c10::ScalarType dtype, bool backward,
                              int64_t chunks);
POSENC_DECLARE_DISPATCH(QkNormRopeFn, qk_norm_rope_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
