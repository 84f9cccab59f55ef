// Meta kernels of rope and rope_: the real kernels' checks, and q's (and k's) shape and
// strides as the backends allocate them (empty_like), with symbolic sizes, so torch.compile
// and torch.export trace them without running them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/meta_support.h"
#include "ops/common/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

RopeCall checked_meta_call(const char* op, torch::jit::Stack* stack) {
  RopeCall c = RopeCall::pop(*stack);
  check_rope_structure(c);
  check_not_mixed_with_meta(op, {{"q", &c.q}, {"k", optional_ptr(c.k)},
                                 {"positions", optional_ptr(c.positions)},
                                 {"offsets", optional_ptr(c.offsets)},
                                 {"cu_seqlens", optional_ptr(c.cu_seqlens)}});
  check_rope_settings(c);
  return c;
}

void rope_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeCall c = checked_meta_call("rope", stack);
  stack->emplace_back(at::empty_like(c.q));
  stack->emplace_back(c.k.has_value() ? at::empty_like(*c.k) : at::empty({0}, c.q.options()));
}

void rope_inplace_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  checked_meta_call("rope_", stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<&rope_meta>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<&rope_inplace_meta>());
}

}  // namespace ops
}  // namespace posenc
