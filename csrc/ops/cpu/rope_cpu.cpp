// CPU backend of the rope ops: the shared front end (rope_checks.h) with outputs advised
// onto huge pages, and dispatch over dtypes to the vectorised kernel in rope_kernel.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "ops/cpu/cpu_support.h"
#include "ops/cpu/rope_kernel.h"
#include "ops/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

void run_rope_cpu(const RopeLaunch& launch, const at::Tensor& q) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "posenc_rope_cpu",
                                  [&] { cpu::rope_tokens<scalar_t>(launch.args); });
}

std::tuple<at::Tensor, at::Tensor> rope_cpu(
    const at::Tensor& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
    int64_t offset, const std::optional<at::Tensor>& cu_seqlens, double base,
    c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
    int64_t rotary_dim, bool interleaved, c10::string_view layout, bool inverse) {
  check_cpu_isa();
  return rope_out_of_place(q, k, positions, offsets, offset, cu_seqlens, base, rope_type, scaling,
                           seq_len, rotary_dim, interleaved, layout, inverse, &empty_output_like,
                           &run_rope_cpu);
}

void rope_inplace_cpu(const at::Tensor& q, const std::optional<at::Tensor>& k,
                      const std::optional<at::Tensor>& positions,
                      const std::optional<at::Tensor>& offsets, int64_t offset,
                      const std::optional<at::Tensor>& cu_seqlens, double base,
                      c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
                      int64_t rotary_dim, bool interleaved, c10::string_view layout,
                      bool inverse) {
  check_cpu_isa();
  rope_in_place(q, k, positions, offsets, offset, cu_seqlens, base, rope_type, scaling, seq_len,
                rotary_dim, interleaved, layout, inverse, &run_rope_cpu);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope", &rope_cpu);
  m.impl("rope_", &rope_inplace_cpu);
}

}  // namespace ops
}  // namespace posenc
