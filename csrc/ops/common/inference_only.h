// The dispatcher layers above the kernels of posenc's ops that write tensor arguments.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

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

// The Negative and Conjugate kernels of the same ops (registered for both keys; `kKey` is
// the one it runs at). Without them ATen's fallback for these keys runs (MathBitsFallback.h):
// a written tensor with the negative bit (a view such as z.conj().imag) is replaced by a
// resolved copy, the kernel (and its alias checks) sees only the copy, and the copy is
// written back afterwards, over memory the op may have written through another argument
// (or, for an op that does not return the written tensor, after an internal assert, with the
// other cache already written). So a written tensor with either bit is a RuntimeError
// before anything is written; a read-only one is resolved (a copy, as the fallback does) and
// the op runs on with the rest as they are.
template <c10::DispatchKey kKey>
void resolve_math_bits(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

}  // namespace ops
}  // namespace posenc

// The layers above the kernels of an op that writes tensor arguments (its family's file
// registers them): bump_written_versions at ADInplaceOrView, resolve_math_bits at Negative
// and Conjugate.
#define POSENC_REGISTER_WRITTEN_LAYERS(op_name)                                                          \
  TORCH_LIBRARY_IMPL(posenc, ADInplaceOrView, m) {                                                       \
    m.impl(op_name, torch::CppFunction::makeFromBoxedFunction<&::posenc::ops::bump_written_versions>()); \
  }                                                                                                      \
  TORCH_LIBRARY_IMPL(posenc, Negative, m) {                                                              \
    m.impl(op_name, torch::CppFunction::makeFromBoxedFunction<                                           \
                        &::posenc::ops::resolve_math_bits<c10::DispatchKey::Negative>>());               \
  }                                                                                                      \
  TORCH_LIBRARY_IMPL(posenc, Conjugate, m) {                                                             \
    m.impl(op_name, torch::CppFunction::makeFromBoxedFunction<                                           \
                        &::posenc::ops::resolve_math_bits<c10::DispatchKey::Conjugate>>());              \
  }
