// CPU backend of the rope ops: argument checks (rope_checks.h), output allocation, and
// dispatch over dtypes to the vectorised kernel in rope_kernel.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "ops/cpu/cpu_support.h"
#include "ops/cpu/rope_kernel.h"
#include "ops/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

void run_rope_cpu(const RopeLaunch& launch, at::ScalarType dtype) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "posenc_rope_cpu",
                                  [&] { cpu::rope_tokens<scalar_t>(launch.args); });
}

std::tuple<at::Tensor, at::Tensor> rope_cpu(
    const at::Tensor& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
    int64_t offset, const std::optional<at::Tensor>& cu_seqlens, double base,
    c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
    int64_t rotary_dim, bool interleaved, c10::string_view layout, bool inverse) {
  check_rope_structure(q, k, positions, offsets, cu_seqlens, rotary_dim, layout);
  check_cpu_isa();
  at::Tensor out_q = empty_output_like(q);
  std::optional<at::Tensor> out_k;
  if (k.has_value()) out_k = empty_output_like(*k);
  const RopeLaunch launch =
      prepare_rope_launch(q, k, positions, offsets, offset, cu_seqlens, base, rope_type, scaling,
                          seq_len, rotary_dim, interleaved, layout, inverse, out_q, out_k);
  run_rope_cpu(launch, q.scalar_type());
  return {out_q, out_k.has_value() ? *out_k : at::empty({0}, q.options())};
}

void rope_inplace_cpu(const at::Tensor& q, const std::optional<at::Tensor>& k,
                      const std::optional<at::Tensor>& positions,
                      const std::optional<at::Tensor>& offsets, int64_t offset,
                      const std::optional<at::Tensor>& cu_seqlens, double base,
                      c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
                      int64_t rotary_dim, bool interleaved, c10::string_view layout,
                      bool inverse) {
  check_rope_structure(q, k, positions, offsets, cu_seqlens, rotary_dim, layout);
  check_rope_inplace(q, k, layout);
  check_cpu_isa();
  const RopeLaunch launch =
      prepare_rope_launch(q, k, positions, offsets, offset, cu_seqlens, base, rope_type, scaling,
                          seq_len, rotary_dim, interleaved, layout, inverse, q, k);
  run_rope_cpu(launch, q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope", &rope_cpu);
  m.impl("rope_", &rope_inplace_cpu);
}

}  // namespace ops
}  // namespace posenc
