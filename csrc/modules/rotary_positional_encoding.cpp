// posenc/rope.h, its module: RotaryPositionalEncoding (the functions are in api/rope.cpp).
#include "posenc/rope.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "api/rope_call_from_options.h"
#include "ops/add_position/position_bounds.h"
#include "ops/common/rope_call.h"

namespace posenc {

RotaryPositionalEncodingImpl::RotaryPositionalEncodingImpl(
    const RotaryPositionalEncodingOptions& options_)
    : options(options_) {
  reset();
}

void RotaryPositionalEncodingImpl::reset() {
  TORCH_CHECK_VALUE(options.dim() > 0, "RotaryPositionalEncoding: expected dim > 0, got ",
                    options.dim());
  TORCH_CHECK_VALUE(options.max_len() > 0, "RotaryPositionalEncoding: expected max_len > 0, got ",
                    options.max_len());
  const int64_t rot = rotary_width();
  TORCH_CHECK_VALUE(rot > 0 && rot % 2 == 0 && rot <= options.dim(),
                    "RotaryPositionalEncoding: expected rotary_dim to be even and at most dim=",
                    options.dim(), ", got ", rot);
  // The model's defaults, as transformers fills them from the config, max_len standing for
  // max_position_embeddings: which type takes which is in its facts (POSENC_ROPE_TYPES).
  RopeScaling& s = options.scaling();
  const unsigned facts = math::rope_type_facts(ops::parse_rope_type(s.rope_type));
  const auto& orig = s.original_max_position_embeddings;
  if ((facts & math::kRopeScalesByLength) && (facts & math::kRopeOriginalFromModel)) {
    // Such a type rescales only positions beyond original_max_position_embeddings, and the
    // module refuses positions at or beyond max_len: a baseline there (or the default,
    // max_len itself) would make the scaling a silent no-op.
    TORCH_CHECK_VALUE(orig.has_value() && *orig < options.max_len(),
                      "RotaryPositionalEncoding: '", s.rope_type, "' scaling needs "
                      "original_max_position_embeddings (the context the model was trained on) "
                      "below max_len=", options.max_len(), ", got ",
                      orig.has_value() ? std::to_string(*orig) : std::string("none"));
  }
  if ((facts & math::kRopeOriginalFromModel) && !orig.has_value()) {
    s.original_max_position_embeddings = static_cast<double>(options.max_len());
  }
  if ((facts & math::kRopeFactorFromModel) && !s.factor.has_value() &&
      !s.attention_factor.has_value() && orig.has_value()) {
    s.factor = static_cast<double>(options.max_len()) / *orig;
  }
  inv_freq();  // validates base, scaling and layout-independent arguments now
}

int64_t RotaryPositionalEncodingImpl::rotary_width() const {
  if (options.rotary_dim().has_value()) return *options.rotary_dim();
  if (options.sections().empty()) return options.dim();
  return ops::rope_sections_width(options.sections());
}

torch::Tensor RotaryPositionalEncodingImpl::inv_freq() const {
  return std::get<0>(rope_frequencies(rotary_width(),
                                      options.base(), options.scaling(), 0, options.sections(),
                                      options.sections_mode()));
}

double RotaryPositionalEncodingImpl::attention_scaling() const {
  return std::get<1>(rope_frequencies(rotary_width(),
                                      options.base(), options.scaling(), 0, options.sections(),
                                      options.sections_mode()));
}

void RotaryPositionalEncodingImpl::pretty_print(std::ostream& stream) const {
  stream << "posenc::RotaryPositionalEncoding(dim=" << options.dim()
         << ", max_len=" << options.max_len() << ", base=" << options.base()
         << ", interleaved=" << (options.interleaved() ? "true" : "false")
         << ", rotary_dim=" << rotary_width()
         << ", scaling=" << options.scaling().rope_type << ", layout=" << options.layout() << ")";
}

ApplyRopeOptions RotaryPositionalEncodingImpl::call_options(const RopePositions& where) const {
  return ApplyRopeOptions()
      .positions(where.positions())
      .offset(where.offset())
      .offsets(where.offsets())
      .cu_seqlens(where.cu_seqlens())
      .base(options.base())
      .interleaved(options.interleaved())
      .rotary_dim(options.rotary_dim())
      .scaling(options.scaling())
      .layout(options.layout())
      .sections(options.sections())
      .sections_mode(options.sections_mode());
}

std::tuple<torch::Tensor, torch::Tensor> RotaryPositionalEncodingImpl::forward(
    const torch::Tensor& q, const torch::Tensor& k, const std::optional<torch::Tensor>& positions,
    int64_t offset) {
  return forward_at(q, k, RopePositions().positions(positions).offset(offset));
}

std::tuple<torch::Tensor, torch::Tensor> RotaryPositionalEncodingImpl::forward_at(
    const torch::Tensor& q, const torch::Tensor& k, const RopePositions& where) {
  // The module's dim is q's and k's head_dim: the frequencies (inv_freq()) and rotary_dim
  // were set up for it, so another width would be rotated with other numbers.
  TORCH_CHECK_VALUE(q.dim() >= 1 && q.size(-1) == options.dim() && k.dim() >= 1 &&
                        k.size(-1) == options.dim(),
                    "RotaryPositionalEncoding: expected q and k with head_dim ", options.dim(),
                    " (the module's dim), got shapes ", q.sizes(), " and ", k.sizes());
  const int64_t max_len = options.max_len();
  // The range check reads index tensors back to the host: a sync for CUDA ones, skipped
  // when the options turn check_positions off. A q of the wrong rank is left to
  // apply_rope's own message.
  const auto on_cuda = [](const std::optional<torch::Tensor>& t) {
    return t.has_value() && !t->is_cpu();
  };
  const bool reads_device = on_cuda(where.positions()) || on_cuda(where.offsets()) ||
                            on_cuda(where.cu_seqlens());
  const ApplyRopeOptions o = call_options(where);
  int64_t lo = 0, hi = -1;
  bool bounded = false;
  const ops::RopeLayoutAxes axes = ops::rope_layout_axes(ops::parse_rope_layout(options.layout()));
  const int64_t rank = axes.batch < 0 ? 3 : 4;  // packed tokens have no batch dim
  if (!where.positions() && !where.offsets() && !where.cu_seqlens() && options.sections().empty() &&
      q.dim() == 4 && axes.batch >= 0) {
    // Positions offset .. offset + seq - 1 (the decode step): the range is arithmetic, as
    // the bounds op would compute it (no token, no bound), without a dispatcher round trip.
    const int64_t batch = q.size(axes.batch);
    const int64_t seq = q.size(axes.seq);
    if (batch > 0 && seq > 0) {
      lo = where.offset();
      // lo + seq - 1 would overflow past INT64_MAX, and so past any max_len: the first
      // position out of range is lo or max_len.
      if (lo > std::numeric_limits<int64_t>::max() - (seq - 1)) {
        ops::throw_position_out_of_range(
            max_len, std::max(lo, max_len),
            c10::str(" (positions range from ", lo, " to ", lo, " + ", seq - 1, ")"));
      }
      hi = lo + (seq - 1);
    }
    bounded = true;
  } else if (q.dim() == rank &&
             (options.check_positions() || !reads_device)) {
    std::tie(lo, hi) = ops::call_rope_position_bounds(detail::make_rope_call(q, k, o, 0));
    bounded = true;
  }
  ops::check_position_range(lo, hi, max_len);
  // A type that scales by length needs the longest position: hand over the one just read
  // rather than have the op read the index tensors again.
  const int64_t seq_len_argument = detail::rope_seq_len_argument(o.scaling());
  const int64_t seq_len =
      bounded && seq_len_argument < 0 ? std::max<int64_t>(hi + 1, 0) : seq_len_argument;
  return ops::call_rope(detail::make_rope_call(q, k, o, seq_len));
}

}  // namespace posenc
