// Meta kernels of qk_norm_rope and its backward: the real kernels' checks, and the outputs'
// shapes and strides as the backends allocate them (like q and k, like the weights), with
// symbolic sizes, so torch.compile and torch.export trace them without running them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/meta_support.h"
#include "ops/qk_norm_rope/qk_norm_rope_call.h"

namespace posenc {
namespace ops {
namespace {

template <bool kBackward>
void qk_norm_rope_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const QkNormRopeCall c = QkNormRopeCall::pop(*stack, kBackward);
  const char* op = kBackward ? "qk_norm_rope_backward" : "qk_norm_rope";
  check_not_mixed_with_meta(op, {{"q", &c.rope.q}, {"k", optional_ptr(c.rope.k)},
                                 {"q_weight", &c.q_weight}, {"k_weight", &c.k_weight},
                                 {"grad_q", &c.grad_q}, {"grad_k", &c.grad_k},
                                 {"positions", optional_ptr(c.rope.positions)},
                                 {"offsets", optional_ptr(c.rope.offsets)},
                                 {"cu_seqlens", optional_ptr(c.rope.cu_seqlens)}});
  check_qk_norm_rope(c, kBackward);
  stack->emplace_back(at::empty_like(c.rope.q));
  stack->emplace_back(at::empty_like(*c.rope.k));
  if (kBackward) {
    stack->emplace_back(at::empty_like(c.q_weight, at::MemoryFormat::Contiguous));
    stack->emplace_back(at::empty_like(c.k_weight, at::MemoryFormat::Contiguous));
  }
}

// qk_norm_rope_: the checks only (the in-place proof reads strides, not data).
void qk_norm_rope_inplace_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const QkNormRopeCall c = QkNormRopeCall::pop(*stack, /*backward=*/false);
  check_not_mixed_with_meta("qk_norm_rope_", {{"q", &c.rope.q}, {"k", optional_ptr(c.rope.k)},
                                              {"q_weight", &c.q_weight}, {"k_weight", &c.k_weight},
                                              {"positions", optional_ptr(c.rope.positions)},
                                              {"offsets", optional_ptr(c.rope.offsets)},
                                              {"cu_seqlens", optional_ptr(c.rope.cu_seqlens)}});
  check_qk_norm_rope(c, /*backward=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("qk_norm_rope_", torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_inplace_meta>());
  m.impl("qk_norm_rope", torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_meta<false>>());
  m.impl("qk_norm_rope_backward",
         torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_meta<true>>());
}

}  // namespace ops
}  // namespace posenc
