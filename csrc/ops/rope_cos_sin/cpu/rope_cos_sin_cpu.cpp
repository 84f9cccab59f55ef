// CPU backend of apply_rope_cos_sin: argument checks, outputs, the tables in the compute
// dtype, and the call of the vector-ISA kernel in rope_cos_sin_kernel.cpp (built once per
// vector ISA, chosen at run time: cpu_capability.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/cpu/cpu_support.h"
#include "ops/rope_cos_sin/cpu/kernel.h"
#include "ops/rope_cos_sin/rope_cos_sin.h"

namespace posenc {
namespace ops {
namespace {

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_cpu(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  const bool bhsd = check_rope_cos_sin(q, k, cos, sin, std::string(layout));
  at::Tensor out_q = empty_output_like(q);
  std::optional<at::Tensor> out_k;
  if (k.has_value()) out_k = empty_output_like(*k);
  if (q.numel() > 0 || (k.has_value() && k->numel() > 0)) {
    const RopeCosSinLaunch launch =
        prepare_rope_cos_sin(q, k, cos, sin, bhsd, interleaved, transpose, out_q, out_k);
    cpu::rope_cos_sin_stub::get()(launch.args, q.scalar_type());
  }
  return {out_q, out_k.has_value() ? *out_k : at::empty({0}, q.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("apply_rope_cos_sin", &apply_rope_cos_sin_cpu);
}

}  // namespace ops
}  // namespace posenc
