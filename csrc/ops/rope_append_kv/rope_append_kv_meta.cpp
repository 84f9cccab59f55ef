// Meta kernels of rope_append_kv and rope_append_kv_: the real kernels' checks and q's (and
// k's) shape, so torch.compile and torch.export trace the op (the caches are mutated
// arguments of the schema: functionalization handles them).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/meta_support.h"
#include "ops/rope_append_kv/rope_append_kv_call.h"

namespace posenc {
namespace ops {
namespace {

RopeAppendKvCall checked_meta_call(const char* op, torch::jit::Stack* stack) {
  RopeAppendKvCall c = RopeAppendKvCall::pop(*stack);
  check_rope_append_kv(c);
  check_not_mixed_with_meta(op, {{"q", &c.rope.q}, {"k", optional_ptr(c.rope.k)}, {"v", &c.v},
                                 {"k_cache", &c.k_cache}, {"v_cache", &c.v_cache},
                                 {"slot_mapping", optional_ptr(c.slot_mapping)},
                                 {"positions", optional_ptr(c.rope.positions)},
                                 {"offset", optional_ptr(c.rope.offsets)}});
  return c;
}

void rope_append_kv_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeAppendKvCall c = checked_meta_call("rope_append_kv", stack);
  stack->emplace_back(at::empty_like(c.rope.q));
  stack->emplace_back(c.return_k ? at::empty_like(*c.rope.k) : at::empty({0}, c.rope.q.options()));
}

void rope_append_kv_inplace_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  checked_meta_call("rope_append_kv_", stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("rope_append_kv", torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_meta>());
  m.impl("rope_append_kv_", torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_inplace_meta>());
}

}  // namespace ops
}  // namespace posenc
