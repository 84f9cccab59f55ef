// posenc::rope_frequencies: the inverse frequencies and attention factor of a RoPE
// configuration, from the same header (posenc/math/rope.h) that the kernels evaluate. It has
// no tensor arguments, so one kernel serves every backend; the result is float64 on the CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

std::tuple<at::Tensor, double> rope_frequencies(int64_t rotary_dim, double base,
                                                c10::string_view rope_type,
                                                at::ArrayRef<double> scaling, int64_t seq_len) {
  const math::RopeScaling s = parse_rope_scaling(rope_type, scaling);
  const std::vector<double> freqs = rope_frequencies_host(rotary_dim, base, s, seq_len);
  at::Tensor out = at::empty({static_cast<int64_t>(freqs.size())}, at::kDouble);
  std::copy(freqs.begin(), freqs.end(), out.mutable_data_ptr<double>());
  return {out, math::rope_attention_factor(s)};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("rope_frequencies", &rope_frequencies);
}

}  // namespace ops
}  // namespace posenc
