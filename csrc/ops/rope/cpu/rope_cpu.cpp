// CPU backend of the rope ops: the shared boxed body (rope/rope_launch.h) with outputs
// from empty_output_like (cpu_support.h: reused blocks of freed outputs), and the call of the vectorised kernel in cpu/kernel.cpp (built
// once per vector ISA, chosen at run time: cpu_capability.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/cpu/cpu_support.h"
#include "ops/rope/cpu/kernel.h"
#include "ops/common/rope_launch.h"

namespace posenc {
namespace ops {
namespace {

void run_rope_cpu(const RopeLaunch& launch, const at::Tensor& q) {
  cpu::rope_stub::get()(launch.args, q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<
                     &rope_kernel_boxed<&empty_output_like, &run_rope_cpu>>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<
                      &rope_inplace_kernel_boxed<&empty_output_like, &run_rope_cpu>>());
}

}  // namespace ops
}  // namespace posenc
