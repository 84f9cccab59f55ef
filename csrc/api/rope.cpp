// posenc/rope.h, its functions: apply_rope, apply_rope_, rope_frequencies,
// rope_grid_positions and RopeScaling::values (the module is in
// modules/rotary_positional_encoding.cpp). They call the ops through the dispatcher.
#include "posenc/rope.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "api/rope_call_from_options.h"
#include "ops/common/op_handles.h"
#include "ops/common/rope_call.h"

namespace posenc {

std::vector<double> RopeScaling::values() const {
  // The op's list: the bitmask of the keys given, every key (0 where not given), the lists.
  std::vector<double> out{0.0};
  uint64_t given = 0;
  int index = 0;
  const auto add = [&](const auto& key) {  // a bool key: 1 or 0
    if (key.has_value()) given |= uint64_t{1} << index;
    out.push_back(key.has_value() ? static_cast<double>(*key) : 0.0);
    ++index;
  };
#define POSENC_X(key) add(key);
  POSENC_ROPE_SCALING_KEYS(POSENC_X)
#undef POSENC_X
  out[0] = static_cast<double>(given);
  TORCH_CHECK_VALUE(short_factor.size() == long_factor.size(),
                    "RopeScaling: expected short_factor and long_factor of equal lengths, got ",
                    short_factor.size(), " and ", long_factor.size());
#define POSENC_X(key) out.insert(out.end(), key.begin(), key.end());
  POSENC_ROPE_SCALING_LIST_KEYS(POSENC_X)
#undef POSENC_X
  return out;
}

namespace detail {

int64_t rope_seq_len_argument(const RopeScaling& s) {
  return math::rope_scales_by_length(ops::parse_rope_type(s.rope_type)) ? -1 : 0;
}

ops::RopeCall make_rope_call(const torch::Tensor& q, const std::optional<torch::Tensor>& k,
                        const ApplyRopeOptions& o, int64_t seq_len) {
  ops::RopeCall c;
  c.q = q;
  c.k = k;
  c.positions = o.positions();
  c.offsets = o.offsets();
  c.offset = o.offset();
  c.cu_seqlens = o.cu_seqlens();
  c.base = o.base();
  c.scaling = ops::parse_rope_scaling(o.scaling().rope_type, o.scaling().values());
  c.seq_len = seq_len;
  c.rotary_dim = o.rotary_dim().value_or(-1);
  c.interleaved = o.interleaved();
  c.layout = ops::parse_rope_layout(o.layout());
  c.sections = o.sections();
  c.sections_mode = ops::parse_rope_sections_mode(o.sections_mode());
  return c;
}

}  // namespace detail

using detail::make_rope_call;
using detail::rope_seq_len_argument;

std::tuple<torch::Tensor, torch::Tensor> apply_rope(const torch::Tensor& q, const torch::Tensor& k,
                                                    const ApplyRopeOptions& o) {
  return ops::call_rope(make_rope_call(q, k, o, rope_seq_len_argument(o.scaling())));
}

torch::Tensor apply_rope(const torch::Tensor& q, const ApplyRopeOptions& o) {
  return std::get<0>(ops::call_rope(make_rope_call(q, std::nullopt, o, rope_seq_len_argument(o.scaling()))));
}

void apply_rope_(const torch::Tensor& q, const std::optional<torch::Tensor>& k,
                 const ApplyRopeOptions& o) {
  ops::call_rope_inplace(make_rope_call(q, k, o, rope_seq_len_argument(o.scaling())));
}

std::tuple<torch::Tensor, double> rope_frequencies(int64_t rotary_dim, double base,
                                                   const RopeScaling& scaling, int64_t seq_len,
                                                   const std::vector<int64_t>& sections,
                                                   const std::string& sections_mode) {
  return ops::rope_frequencies_op().call(rotary_dim, base, scaling.rope_type, scaling.values(),
                                         seq_len, sections, sections_mode);
}

std::tuple<torch::Tensor, torch::Tensor> apply_rope_cos_sin(const torch::Tensor& q,
                                                            const torch::Tensor& k,
                                                            const torch::Tensor& cos,
                                                            const torch::Tensor& sin,
                                                            const std::string& layout,
                                                            bool interleaved) {
  return ops::apply_rope_cos_sin_op().call(
      q, k.defined() ? std::optional<torch::Tensor>(k) : std::nullopt, cos, sin, layout,
      interleaved, /*transpose=*/false);
}

torch::Tensor rope_grid_positions(const std::vector<int64_t>& grid, int64_t num_prefix_tokens,
                                  const torch::Device& device) {
  return ops::rope_grid_positions_op().call(grid, num_prefix_tokens, device);
}

}  // namespace posenc
