// The Autograd kernel of ops that write a KV cache (rope_append_kv(_), rope_shift_kv_): they
// have no derivative (inference). Under grad mode, a tensor argument that requires grad is an
// error naming it, rather than an output silently detached from the graph; a tangent (forward
// AD) too, rather than dropped. The tensors the op writes (the schema's (a!) arguments) have
// their version counters moved, as an ATen in-place op's, so that autograd refuses a graph
// that saved one of them before this write.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace posenc {
namespace ops {

void inference_only_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack);

}  // namespace ops
}  // namespace posenc
