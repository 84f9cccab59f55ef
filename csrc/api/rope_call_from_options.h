// The C++ API's options as the op's parsed call: one translation, shared by the functions
// (api/rope.cpp) and the module (modules/rotary_positional_encoding.cpp).
#pragma once

#include <torch/types.h>

#include <optional>

#include "ops/common/rope_call.h"
#include "posenc/rope.h"

namespace posenc {
namespace detail {

// The op's view of a C++ API call (positions, offsets, scaling... from the options).
ops::RopeCall make_rope_call(const torch::Tensor& q, const std::optional<torch::Tensor>& k,
                             const ApplyRopeOptions& o, int64_t seq_len);

// -1 lets the op read the longest position of the call for a type that scales by length
// (math::rope_scales_by_length), else 0.
int64_t rope_seq_len_argument(const RopeScaling& s);

}  // namespace detail
}  // namespace posenc
