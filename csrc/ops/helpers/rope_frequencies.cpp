// The frequencies of a RoPE configuration, one per rotary pair, with the position axis each
// pair reads (multi-axis RoPE), from the same header (posenc/math/rope.h) the kernels use;
// and the op posenc::rope_frequencies that returns them. The op has no tensor arguments, so
// one kernel serves every backend; the result is float64 on the CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "ops/common/rope_checks.h"
#include "ops/common/rope_launch.h"

namespace posenc {
namespace ops {

RopePairFrequencies rope_pair_frequencies(int64_t rotary_dim, double base,
                                          const math::RopeScalingParams& scaling, int64_t seq_len,
                                          const std::vector<int64_t>& sections,
                                          math::RopeSectionsMode sections_mode) {
  const int64_t one_axis[1] = {rotary_dim / 2};
  const int64_t* secs = sections.empty() ? one_axis : sections.data();
  const int n_axes = sections.empty() ? 1 : static_cast<int>(sections.size());
  RopePairFrequencies f;
  f.attention_factor = math::rope_attention_factor(scaling);
  for (int64_t p = 0; p < rotary_dim / 2; ++p) {
    int64_t width = 0, index = 0;
    math::rope_pair_frequency_index(p, rotary_dim, secs, n_axes, sections_mode, &width, &index);
    const double freq = math::rope_inv_freq(index, width, base, scaling, seq_len);
    // Each key is checked alone; extreme combinations (a linear factor of 1e-310, a
    // dynamic base beyond float64) could still give inf or 0 frequencies, i.e. NaN or
    // unrotated outputs.
    // ("proportional" leaves its last pairs unturned: frequency 0.)
    const bool unturned = scaling.type == math::RopeType::kProportional && freq == 0.0;
    // At most kRopeMaxInvFreq: the angles' reduction is exact to that bound (math/rope.h).
    TORCH_CHECK_VALUE(std::isfinite(freq) && (freq > 0.0 || unturned) && freq <= math::kRopeMaxInvFreq,
                      "posenc: the RoPE settings (base ", base, ", rotary_dim ", rotary_dim,
                      ", the scaling keys, seq_len ", seq_len, ") give inverse frequency ", freq, " for pair ",
                      p, "; expected finite positive frequencies of at most 2**16");
    f.inv_freq.push_back(freq);
    f.axis.push_back(static_cast<uint8_t>(math::rope_pair_axis(p, secs, n_axes, sections_mode)));
  }
  return f;
}

namespace {

std::tuple<at::Tensor, double> rope_frequencies(int64_t rotary_dim, double base,
                                                c10::string_view rope_type,
                                                at::ArrayRef<double> scaling, int64_t seq_len,
                                                at::IntArrayRef sections,
                                                c10::string_view sections_mode) {
  const std::string type(rope_type.data(), rope_type.size());
  const std::string mode_name(sections_mode.data(), sections_mode.size());
  const math::RopeScalingParams params = parse_rope_scaling(type, scaling.vec());
  const math::RopeSectionsMode mode = parse_rope_sections_mode(mode_name);
  TORCH_CHECK_VALUE(rotary_dim > 0 && rotary_dim % 2 == 0,
                    "posenc: expected rotary_dim to be a positive even number, got ", rotary_dim);
  // The kernels hold the frequencies per launch: a module with a larger dim would build
  // and then fail at its first call, so rope_frequencies refuses it too.
  check_rope_rotary_dim_supported(rotary_dim);
  check_rope_base(base);
  check_rope_scaling(params);
  check_rope_sections(sections.vec(), mode, rotary_dim);
  check_rope_scaling_lists(params, rotary_dim, !sections.empty());
  TORCH_CHECK_VALUE(seq_len >= 0, "posenc: expected seq_len >= 0, got ", seq_len);
  const RopePairFrequencies f =
      rope_pair_frequencies(rotary_dim, base, params, seq_len, sections.vec(), mode);
  at::Tensor out = at::empty({static_cast<int64_t>(f.inv_freq.size())}, at::kDouble);
  std::copy(f.inv_freq.begin(), f.inv_freq.end(), out.mutable_data_ptr<double>());
  return {out, f.attention_factor};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  m.def(
      "rope_frequencies(int rotary_dim, float base=10000.0, str rope_type=\"default\", "
      "float[] scaling=[], int seq_len=0, int[] sections=[], str sections_mode=\"axial\") "
      "-> (Tensor, float)");
}

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("rope_frequencies", &rope_frequencies);
}

}  // namespace ops
}  // namespace posenc
