// The dispatcher layers above the kernels of posenc's ops that write tensor arguments.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace posenc {
namespace ops {

// The Autograd kernel of ops that write a KV cache (rope_append_kv(_), rope_shift_kv_): they
// have no derivative (inference). Under grad mode, a tensor argument that requires grad is an
// error naming it, rather than an output silently detached from the graph; a tangent (forward
// AD) too, rather than dropped.
void inference_only_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack);

// The ADInplaceOrView kernel of every op that writes tensor arguments (the schema's (a!)
// ones: rope_, qk_norm_rope_, rope_append_kv(_), rope_shift_kv_): the op below this layer,
// then the version counters of the tensors it wrote moved, where ATen's in-place ops move
// them, so that autograd refuses a graph that saved one of them before the write. This layer
// also runs under torch.inference_mode() for normal tensors (autograd does not), so a write
// there is seen too; and outside it for inference tensors (made under inference mode, which
// have no autograd keys), whose in-place update is a RuntimeError there, as ATen's, raised
// before anything is written.
void bump_written_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                           torch::jit::Stack* stack);

}  // namespace ops
}  // namespace posenc
