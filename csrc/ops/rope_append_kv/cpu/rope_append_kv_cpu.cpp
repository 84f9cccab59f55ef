// CPU backend of rope_append_kv / rope_append_kv_: the shared boxed body
// (rope_append_kv_call.h) with every row or slot checked before the kernel writes anything
// (IndexError, the caches unchanged), and the vectorised kernel of cpu/kernel.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/cpu/cpu_support.h"
#include "ops/rope_append_kv/cpu/kernel.h"
#include "ops/rope_append_kv/rope_append_kv_call.h"

namespace posenc {
namespace ops {
namespace {

void run_rope_append_kv_cpu(const KvLaunch& launch, const at::Tensor& q) {
  cpu::rope_append_kv_stub::get()(launch.args, q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope_append_kv",
         torch::CppFunction::makeFromBoxedFunction<
             &rope_append_kv_kernel_boxed<&empty_output_like, &run_rope_append_kv_cpu, true>>());
  m.impl("rope_append_kv_",
         torch::CppFunction::makeFromBoxedFunction<
             &rope_append_kv_inplace_kernel_boxed<&empty_output_like, &run_rope_append_kv_cpu, true>>());
}

}  // namespace ops
}  // namespace posenc
