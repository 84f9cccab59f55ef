// One qk_norm_rope call (RMSNorm of q and k, then RoPE; Qwen3, Gemma 3, OLMo 2), parsed once:
// the RoPE arguments as RopeCall reads them (every RoPE feature, the same schema tail
// kRopeSchemaArguments), plus the norm's (weights, eps, weight_offset, norm), and in the
// backward the incoming gradients. The checks, launch preparation and boxed kernel bodies
// that every backend (CPU, CUDA, Meta, the ATen composite) shares: defined in qk_norm_rope.cpp
// (autograd in autograd.cpp, the CUDA kernels in cuda/qk_norm_rope/qk_norm_rope.cu).
//
// Schemas (the norm's arguments sit between k and the RoPE tail):
//   qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps=1e-06,
//                float weight_offset=0.0, str norm="head", <RoPE tail>) -> (Tensor, Tensor)
//   qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, <as qk_norm_rope>) -> ()   (in place)
//   qk_norm_rope_backward(Tensor q, Tensor k, Tensor grad_q, Tensor grad_k, Tensor q_weight,
//                Tensor k_weight, float eps, float weight_offset, str norm, <RoPE tail>)
//                -> (grad q, grad k, grad q_weight, grad k_weight)
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/stack.h>

#include <tuple>

#include "ops/common/rope_call.h"
#include "ops/common/rope_launch.h"
#include "ops/qk_norm_rope/cpu/kernel.h"  // QkNorm, QkNormRopeArgs (plain data)

namespace posenc {
namespace ops {

struct QkNormRopeCall {
  RopeCall rope;  // q, k and the RoPE arguments
  at::Tensor grad_q, grad_k;  // backward only
  at::Tensor q_weight, k_weight;
  double eps = 1e-6;
  double weight_offset = 0.0;
  QkNorm norm = QkNorm::kHead;
  const char* op = "qk_norm_rope";  // the op its checks' messages name (rope_append_kv's QK-norm too)

  // Pops a boxed call of qk_norm_rope (backward=false) or qk_norm_rope_backward.
  static QkNormRopeCall pop(torch::jit::Stack& stack, bool backward);
  void push(torch::jit::Stack& stack, bool backward) const;
};

// The norm's settings with their defaults, as the schemas of qk_norm_rope and of
// rope_append_kv (its QK-norm) declare them.
constexpr const char* kQkNormSchemaSettings =
    "float eps=1e-06, float weight_offset=0.0, str norm=\"head\"";

QkNorm parse_qk_norm(const std::string& name);
// The weights a kernel reads: weight + weight_offset in the norm's compute dtype (float32,
// float64 for float64 q), contiguous.
at::Tensor qk_norm_effective_weight(const at::Tensor& weight, double weight_offset, const at::Tensor& q);
const char* qk_norm_name(QkNorm norm);

// The in-place call's own checks (qk_norm_rope_): q and k are written, so neither may
// overlap itself, the other, the weights or the index tensors (check_written_memory,
// rope_checks.h).
void check_qk_norm_rope_inplace(const QkNormRopeCall& call);

// Every check of a call, on any device (Meta included: symbolic sizes): RoPE's, then eps,
// weight_offset, the weights (1-D, head_dim or heads * head_dim values by norm, q's dtype
// or float32 for half-precision q, q's device) and in the backward the gradients (q's and
// k's shapes and dtype). Returns the resolved rotary_dim.
int64_t check_qk_norm_rope(const QkNormRopeCall& call, bool backward);

// A checked call ready for a kernel: RoPE's launch (q, k views and the out / dx views), the
// norm's parameters, and the tensors the pointers point into.
struct QkNormRopeLaunch {
  QkNormRopeArgs args;
  RopeLaunch rope;  // rope.args is copied into args.rope
  at::Tensor grad_q, grad_k;      // canonical views (backward)
  at::Tensor q_weight, k_weight;  // effective weights, compute dtype, contiguous
  // Backward: filled by the backend runner, compute dtype, shape of the weights.
  at::Tensor q_weight_grad, k_weight_grad;
};

// A backend: its output allocation and its kernel runs.
using QkNormRopeAllocator = at::Tensor (*)(const at::Tensor& like);
using QkNormRopeRunner = void (*)(QkNormRopeLaunch& launch, const at::Tensor& q, bool backward);

// The boxed bodies of every backend: pop, check, allocate, prepare, run, push.
void run_qk_norm_rope_boxed(torch::jit::Stack* stack, bool backward,
                            QkNormRopeAllocator allocate, QkNormRopeRunner run);

template <QkNormRopeAllocator Allocate, QkNormRopeRunner Run>
void qk_norm_rope_kernel_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_qk_norm_rope_boxed(stack, /*backward=*/false, Allocate, Run);
}
// qk_norm_rope_: the checks (with check_qk_norm_rope_inplace), then the kernel with q and k
// as their own outputs.
void run_qk_norm_rope_inplace_boxed(torch::jit::Stack* stack, QkNormRopeRunner run);

template <QkNormRopeRunner Run>
void qk_norm_rope_inplace_kernel_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_qk_norm_rope_inplace_boxed(stack, Run);
}
template <QkNormRopeAllocator Allocate, QkNormRopeRunner Run>
void qk_norm_rope_backward_kernel_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_qk_norm_rope_boxed(stack, /*backward=*/true, Allocate, Run);
}

// The boxed op calls (C++ API, autograd).
std::tuple<at::Tensor, at::Tensor> call_qk_norm_rope(const QkNormRopeCall& call);
void call_qk_norm_rope_inplace(const QkNormRopeCall& call);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_qk_norm_rope_backward(
    const QkNormRopeCall& call);

// The same two computations composed of ATen ops and the rope op (differentiable: the
// double backward, and the ATen fallback of devices without a kernel). In the compute
// dtype, outputs rounded once to the inputs' dtypes. In qk_norm_rope.cpp.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_composite(const QkNormRopeCall& call);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_backward_composite(
    const QkNormRopeCall& call);

// The forward-mode derivative of one operand's norm, before the rotation: the tangent of
// RMSNorm(x) * (w + weight_offset) given x's tangent tx and w's tangent tw (either undefined:
// none; both: an undefined result), i.e. J(x) tx * w' + RMSNorm(x) tw, with the backward
// composite's own norm Jacobian J. In x's layout and the compute dtype; the caller rotates
// it with the call's RoPE (the op is rope of this).
at::Tensor qk_norm_tangent(const QkNormRopeCall& call, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& tx, const at::Tensor& tw);

}  // namespace ops
}  // namespace posenc
