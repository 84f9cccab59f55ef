// posenc/rope.h: apply_rope, rope_frequencies and the RotaryPositionalEncoding module.
#include "posenc/rope.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "ops/op_handles.h"
#include "ops/rope/rope_call.h"

namespace posenc {

std::vector<double> RopeScaling::values() const {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto value = [nan](const auto& key) -> double {
    return key.has_value() ? static_cast<double>(*key) : nan;  // a bool: 1 or 0
  };
  std::vector<double> out;
#define POSENC_X(key) out.push_back(value(key));
  POSENC_ROPE_SCALING_KEYS(POSENC_X)
#undef POSENC_X
  return out;
}

namespace {

// -1 lets the op read the longest position of the call ("dynamic" only).
int64_t seq_len_argument(const RopeScaling& s) { return s.rope_type == "dynamic" ? -1 : 0; }

// The op's view of a C++ API call.
ops::RopeCall make_call(const torch::Tensor& q, const std::optional<torch::Tensor>& k,
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

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> apply_rope(const torch::Tensor& q, const torch::Tensor& k,
                                                    const ApplyRopeOptions& o) {
  return ops::call_rope(make_call(q, k, o, seq_len_argument(o.scaling())));
}

torch::Tensor apply_rope(const torch::Tensor& q, const ApplyRopeOptions& o) {
  return std::get<0>(ops::call_rope(make_call(q, std::nullopt, o, seq_len_argument(o.scaling()))));
}

void apply_rope_(const torch::Tensor& q, const std::optional<torch::Tensor>& k,
                 const ApplyRopeOptions& o) {
  ops::call_rope_inplace(make_call(q, k, o, seq_len_argument(o.scaling())));
}

std::tuple<torch::Tensor, double> rope_frequencies(int64_t rotary_dim, double base,
                                                   const RopeScaling& scaling, int64_t seq_len,
                                                   const std::vector<int64_t>& sections,
                                                   const std::string& sections_mode) {
  return ops::rope_frequencies_op().call(rotary_dim, base, scaling.rope_type, scaling.values(),
                                         seq_len, sections, sections_mode);
}

torch::Tensor rope_grid_positions(const std::vector<int64_t>& grid, int64_t num_prefix_tokens,
                                  const torch::Device& device) {
  return ops::rope_grid_positions_op().call(grid, num_prefix_tokens, device);
}

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
  RopeScaling& s = options.scaling();
  if (s.rope_type == "dynamic") {
    // "dynamic" rescales only positions beyond original_max_position_embeddings, and the
    // module refuses positions at or beyond max_len: a baseline there would be a no-op.
    TORCH_CHECK_VALUE(s.original_max_position_embeddings.has_value() &&
                          *s.original_max_position_embeddings < options.max_len(),
                      "RotaryPositionalEncoding: 'dynamic' scaling needs "
                      "original_max_position_embeddings (the context the model was trained on) "
                      "below max_len=", options.max_len(), ", got ",
                      s.original_max_position_embeddings.has_value()
                          ? std::to_string(*s.original_max_position_embeddings)
                          : std::string("none"));
  }
  if (s.rope_type == "yarn" && !s.original_max_position_embeddings.has_value()) {
    s.original_max_position_embeddings = static_cast<double>(options.max_len());
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
  if (q.dim() == (options.layout() == "thd" ? 3 : 4) &&
      (options.check_positions() || !reads_device)) {
    std::tie(lo, hi) = ops::call_rope_position_bounds(make_call(q, k, o, 0));
    bounded = true;
  }
  TORCH_CHECK_INDEX(hi < lo || (lo >= 0 && hi < max_len),
                    "posenc: expected positions in [0, max_len=", max_len, "), got values from ",
                    lo, " to ", hi);
  // "dynamic" needs the longest position: hand over the one just read rather than have the
  // op read the index tensors again.
  const int64_t seq_len =
      bounded && options.scaling().rope_type == "dynamic" ? std::max<int64_t>(hi + 1, 0)
                                                          : seq_len_argument(o.scaling());
  return ops::call_rope(make_call(q, k, o, seq_len));
}

}  // namespace posenc
