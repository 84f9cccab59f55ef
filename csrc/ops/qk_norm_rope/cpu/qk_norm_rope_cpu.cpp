// CPU backend of qk_norm_rope and its backward: the shared boxed body
// (qk_norm_rope_call.h) with outputs from empty_output_like (cpu_support.h), and the
// vectorised kernel of cpu/kernel.cpp (one build per vector ISA, chosen at run time).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/cpu/cpu_support.h"
#include "ops/qk_norm_rope/cpu/kernel.h"
#include "ops/qk_norm_rope/qk_norm_rope_call.h"

namespace posenc {
namespace ops {
namespace {

void run_qk_norm_rope_cpu(QkNormRopeLaunch& l, const at::Tensor& q, bool backward) {
  int64_t chunks = 0;
  if (backward) {
    // Per-chunk partial sums of the weight gradients (compute dtype); row 0 holds the total.
    chunks = std::max<int64_t>(1, cpu::qk_norm_chunks(l.args.rope.batch * l.args.rope.seq));
    l.q_weight_grad = at::zeros({chunks, l.q_weight.size(0)}, l.q_weight.options());
    l.k_weight_grad = at::zeros({chunks, l.k_weight.size(0)}, l.k_weight.options());
    l.args.q_weight_grad = l.q_weight_grad.mutable_data_ptr();
    l.args.k_weight_grad = l.k_weight_grad.mutable_data_ptr();
  }
  cpu::qk_norm_rope_stub::get()(l.args, q.scalar_type(), backward, chunks);
  if (backward) {
    l.q_weight_grad = l.q_weight_grad[0];
    l.k_weight_grad = l.k_weight_grad[0];
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("qk_norm_rope", torch::CppFunction::makeFromBoxedFunction<
                             &qk_norm_rope_kernel_boxed<&empty_output_like, &run_qk_norm_rope_cpu>>());
  m.impl("qk_norm_rope_", torch::CppFunction::makeFromBoxedFunction<
                              &qk_norm_rope_inplace_kernel_boxed<&run_qk_norm_rope_cpu>>());
  m.impl("qk_norm_rope_backward",
         torch::CppFunction::makeFromBoxedFunction<
             &qk_norm_rope_backward_kernel_boxed<&empty_output_like, &run_qk_norm_rope_cpu>>());
}

}  // namespace ops
}  // namespace posenc
