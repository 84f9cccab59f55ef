// posenc/rope.h: apply_rope, apply_rope_, rope_frequencies, apply_rope_cos_sin,
// rope_grid_positions, RopeScaling::values and the module RotaryPositionalEncoding. They
// call the ops through the dispatcher.
#include <algorithm>
#include <c10/util/Exception.h>
#include <cmath>
#include <limits>

#include "module_state.h"
#include "ops/common/position_range.h"
#include "ops/common/op_handles.h"
#include "ops/common/rope_call.h"
#include "posenc/rope.h"

// ---- Functions
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

int64_t rope_seq_len_argument(const RopeScaling& s, std::optional<int64_t> seq_len) {
  TORCH_CHECK_VALUE(!seq_len.has_value() || *seq_len >= 0,
                    "posenc: expected seq_len >= 0 (the longest position + 1), got ", *seq_len);
  if (!math::rope_scales_by_length(ops::parse_rope_type(s.rope_type))) return 0;
  return seq_len.value_or(-1);  // -1: the op reads the longest position
}

ops::RopeCall make_rope_call(const torch::Tensor& q, const std::optional<torch::Tensor>& k,
                        const ApplyRopeOptions& o, int64_t seq_len) {
  ops::RopeCall c;
  c.q = q;
  c.k = k;  // as given: optional only in rope (apply_rope's callers decide)
  c.positions = ops::optional_tensor(o.positions());
  c.offsets = ops::optional_tensor(o.offsets());
  c.offset = o.offset();
  c.cu_seqlens = ops::optional_tensor(o.cu_seqlens());
  c.inverse = o.inverse();
  c.base = o.base();
  c.scaling = ops::parse_rope_scaling(o.scaling().rope_type, o.scaling().values());
  c.seq_len = seq_len;
  c.rotary_dim = o.rotary_dim().value_or(-1);
  c.interleaved = o.interleaved();
  c.layout = ops::parse_rope_layout(o.layout());
  c.sections = o.sections();
  c.sections_mode = ops::parse_rope_sections_mode(o.sections_mode());
#define POSENC_X(type, name, default_value, schema_type) c.settings.name = o.name();
  POSENC_ROPE_SETTINGS(POSENC_X)
#undef POSENC_X
  return c;
}

void set_rope_positions(ops::RopeCall& call, const RopePositions& where) {
  call.positions = ops::optional_tensor(where.positions());
  call.offsets = ops::optional_tensor(where.offsets());
  call.offset = where.offset();
  call.cu_seqlens = ops::optional_tensor(where.cu_seqlens());
}

}  // namespace detail

using detail::make_rope_call;
using detail::rope_seq_len_argument;

std::tuple<torch::Tensor, torch::Tensor> apply_rope(const torch::Tensor& q, const torch::Tensor& k,
                                                    const ApplyRopeOptions& o) {
  // An undefined k (torch::Tensor()): q alone, the second output undefined (as the module).
  auto [rq, rk] = ops::call_rope(make_rope_call(q, k.defined() ? std::optional<torch::Tensor>(k) : std::nullopt, o,
                                                rope_seq_len_argument(o.scaling(), o.seq_len())));
  return {rq, k.defined() ? rk : torch::Tensor()};
}

torch::Tensor apply_rope(const torch::Tensor& q, const ApplyRopeOptions& o) {
  return std::get<0>(
      ops::call_rope(make_rope_call(q, std::nullopt, o, rope_seq_len_argument(o.scaling(), o.seq_len()))));
}

void apply_rope_(const torch::Tensor& q, const std::optional<torch::Tensor>& k,
                 const ApplyRopeOptions& o) {
  ops::call_rope_inplace(
      make_rope_call(q, ops::optional_tensor(k), o, rope_seq_len_argument(o.scaling(), o.seq_len())));
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
  auto out = ops::apply_rope_cos_sin_op().call(
      q, k.defined() ? std::optional<torch::Tensor>(k) : std::nullopt, cos, sin, layout,
      interleaved, /*transpose=*/false);
  // The op returns an empty tensor for a missing k; C++ callers get an undefined one, as
  // apply_rope and the module give (an optional tensor is an undefined one: docs/cpp.md).
  if (!k.defined()) std::get<1>(out) = torch::Tensor();
  return out;
}

torch::Tensor rope_grid_positions(const std::vector<int64_t>& grid, int64_t num_prefix_tokens,
                                  const torch::Device& device) {
  return ops::rope_grid_positions_op().call(grid, num_prefix_tokens, device);
}

}  // namespace posenc

// ---- The module
namespace posenc {
namespace detail {

struct ParsedRope {
  ops::RopeCall call;        // every setting; q, k and the positions unset
  int64_t seq_len_argument;  // rope_seq_len_argument of the scaling
  int64_t rotary_width;      // the op's (rope_rotary_width)
  RopeScaling scaling;       // options.scaling() with the model's defaults filled in
  // What inv_freq(), attention_scaling() and forward read besides: as reset() saw them
  // (options edited since, without a reset(), change nothing; check_positions, a switch of
  // the range check's cost, is read live).
  double base;
  std::vector<int64_t> sections;
  std::string sections_mode;
  int64_t dim;
  int64_t max_len;
};

}  // namespace detail
}  // namespace posenc

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
  // The model's defaults, as transformers fills them from the config, from its
  // max_position_embeddings (default max_len): which type takes which is in its facts
  // (POSENC_ROPE_TYPES).
  const int64_t model_len = options.max_position_embeddings().value_or(options.max_len());
  TORCH_CHECK_VALUE(model_len > 0, "RotaryPositionalEncoding: expected max_position_embeddings > 0, got ",
                    model_len);
  // Filled into a copy: `options` stays as the user gave it, so a reset() after changing
  // max_len derives them again (written back, they read as given: a stale baseline).
  RopeScaling s = options.scaling();
  const unsigned facts = math::rope_type_facts(ops::parse_rope_type(s.rope_type));
  const std::optional<double> given = s.original_max_position_embeddings;
  // The baseline: the dict's, else the model's length (max_position_embeddings, default max_len).
  if ((facts & math::kRopeOriginalFromModel) && !given.has_value()) {
    s.original_max_position_embeddings = static_cast<double>(model_len);
  }
  if ((facts & math::kRopeScalesByLength) && (facts & math::kRopeOriginalFromModel)) {
    // transformers scales "dynamic" by the config's max_position_embeddings and ignores the
    // dict's key; posenc reads the key: both given and different are two readings (as in Python).
    TORCH_CHECK_VALUE(!given.has_value() || !options.max_position_embeddings().has_value() ||
                          *given == static_cast<double>(model_len),
                      "RotaryPositionalEncoding: rope_type '", s.rope_type, "' scales beyond one length: "
                      "transformers reads the config's max_position_embeddings (", model_len, ") and ignores "
                      "the dict's original_max_position_embeddings (", given.value_or(0.0), "); pass one of "
                      "them, or equal ones");
    // Such a type rescales only positions beyond original_max_position_embeddings, and the
    // module refuses positions at or beyond max_len: a baseline there (or the default,
    // max_len itself) would make the scaling a silent no-op.
    const double orig = *s.original_max_position_embeddings;
    TORCH_CHECK_VALUE(orig < options.max_len(),
                      "RotaryPositionalEncoding: '", s.rope_type, "' scaling needs "
                      "original_max_position_embeddings (the context the model was trained on) "
                      "below max_len=", options.max_len(), ", got ",
                      given.has_value() || options.max_position_embeddings().has_value()
                          ? std::to_string(orig)
                          : std::string("none (its default, max_len, would never rescale)"));
  }
  const auto& orig = s.original_max_position_embeddings;  // as filled above
  if ((facts & math::kRopeFactorFromModel) && !s.factor.has_value() && orig.has_value() &&
      *orig > 0) {  // else the op names the key
    s.factor = static_cast<double>(model_len) / *orig;
  }
  // The options as the op reads them, parsed once (names, the scaling dict); every forward
  // copies this call and sets its tensors and positions.
  ApplyRopeOptions o;
#define POSENC_X(type, name, ...) o.name(options.name());
  POSENC_ROPE_CONFIG_OPTIONS(POSENC_X)
  POSENC_ROPE_SETTINGS(POSENC_X)
#undef POSENC_X
  o.scaling(s);  // with the model's defaults
  const int64_t seq_len_argument = detail::rope_seq_len_argument(o.scaling());
  ops::RopeCall call = detail::make_rope_call(at::Tensor(), std::nullopt, o, seq_len_argument);
  // The op checks every value now, for heads of dim features (an empty q), and resolves the
  // rotary width (its rule is stated once, in the op).
  ops::RopeCall probe = call;
  if (call.layout == ops::RopeLayout::kTHD) {
    probe.q = at::empty({0, 1, options.dim()});
    probe.cu_seqlens = at::zeros({1}, at::kLong);
  } else {
    probe.q = at::empty({0, 0, 1, options.dim()});
  }
  const int64_t width = ops::call_rope_rotary_width(probe);
  parsed_ = std::make_shared<const detail::ParsedRope>(
      detail::ParsedRope{std::move(call), seq_len_argument, width, s, options.base(), options.sections(),
                         options.sections_mode(), options.dim(), options.max_len()});
  inv_freq();  // checks what the op's empty call could not (rope_frequencies' own checks)
}


void RotaryPositionalEncodingImpl::load(torch::serialize::InputArchive& archive) {
  detail::load_same_shapes(*this, archive);
}

int64_t RotaryPositionalEncodingImpl::rotary_width() const { return parsed_->rotary_width; }

// The frequencies of the options reset() parsed (those forward rotates with), not of options
// edited since.
torch::Tensor RotaryPositionalEncodingImpl::inv_freq() const {
  const detail::ParsedRope& p = *parsed_;
  return std::get<0>(rope_frequencies(p.rotary_width, p.base, p.scaling, 0, p.sections, p.sections_mode));
}

double RotaryPositionalEncodingImpl::attention_scaling() const {
  const detail::ParsedRope& p = *parsed_;
  return std::get<1>(rope_frequencies(p.rotary_width, p.base, p.scaling, 0, p.sections, p.sections_mode));
}

void RotaryPositionalEncodingImpl::pretty_print(std::ostream& stream) const {
  // The settings forward uses: as reset() parsed them (options edited since change nothing).
  const detail::ParsedRope& parsed = *parsed_;
  stream << "posenc::RotaryPositionalEncoding(dim=" << parsed.dim << ", max_len=" << parsed.max_len
         << ", base=" << parsed.base << ", interleaved=" << (parsed.call.interleaved ? "true" : "false")
         << ", rotary_dim=" << parsed.rotary_width << ", scaling=" << parsed.scaling.rope_type
         << ", layout=" << ops::rope_layout_name(parsed.call.layout) << ")";
}

std::tuple<torch::Tensor, torch::Tensor> RotaryPositionalEncodingImpl::forward(
    const torch::Tensor& q, const torch::Tensor& k, const std::optional<torch::Tensor>& positions,
    int64_t offset) {
  return forward_at(q, k, RopePositions().positions(positions).offset(offset));
}

std::tuple<torch::Tensor, torch::Tensor> RotaryPositionalEncodingImpl::forward_at(
    const torch::Tensor& q, const torch::Tensor& k, const RopePositions& where) {
  const detail::ParsedRope& parsed = *parsed_;  // the options as reset() parsed them
  // The module's dim is q's and k's head_dim: the frequencies (inv_freq()) and rotary_dim
  // were set up for it, so another width would be rotated with other numbers.
  // An undefined k: q alone is rotated (Python's rope(x)); the second output is undefined.
  TORCH_CHECK_VALUE(q.dim() >= 1 && q.size(-1) == parsed.dim &&
                        (!k.defined() || (k.dim() >= 1 && k.size(-1) == parsed.dim)),
                    "RotaryPositionalEncoding: expected q and k with head_dim ", parsed.dim,
                    " (the module's dim), got shapes ", q.sizes(), " and ",
                    k.defined() ? c10::str(k.sizes()) : std::string("(none)"));
  const int64_t max_len = parsed.max_len;
  // The range check reads index tensors back to the host: a sync for CUDA ones, skipped
  // when the options turn check_positions off. A q of the wrong rank is left to
  // apply_rope's own message.
  const auto on_cuda = [](const std::optional<torch::Tensor>& t) {
    return t.has_value() && !t->is_cpu();
  };
  const auto on_meta = [](const std::optional<torch::Tensor>& t) { return t.has_value() && t->is_meta(); };
  ops::RopeCall call = parsed.call;
  call.q = q;
  call.k = k.defined() ? std::optional<torch::Tensor>(k) : std::nullopt;
  detail::set_rope_positions(call, where);
  const bool reads_device = on_cuda(call.positions) || on_cuda(call.offsets) || on_cuda(call.cu_seqlens);
  int64_t lo = 0, hi = -1;
  bool bounded = false;
  const ops::RopeLayoutAxes axes = ops::rope_layout_axes(call.layout);
  const int64_t rank = axes.batch < 0 ? 3 : 4;  // packed tokens have no batch dim
  if (!call.positions && !call.offsets && !call.cu_seqlens && parsed.sections.empty() &&
      q.dim() == 4 && axes.batch >= 0) {
    // Positions offset .. offset + seq - 1 (the decode step): the range is arithmetic, as
    // the bounds op would compute it (no token, no bound), without a dispatcher round trip.
    const int64_t batch = q.size(axes.batch);
    const int64_t seq = q.size(axes.seq);
    if (batch > 0 && seq > 0) {
      ops::check_position_run(where.offset(), seq, max_len);
      lo = where.offset();
      hi = lo + (seq - 1);  // in int64: checked above
    }
    bounded = true;
  } else if (q.dim() == rank && !q.is_meta() && !on_meta(call.positions) && !on_meta(call.offsets) &&
             !on_meta(call.cu_seqlens) &&  // meta: shapes only, nothing to read
             (options.check_positions() || !reads_device)) {
    call.seq_len = 0;
    std::tie(lo, hi) = ops::call_rope_position_bounds(call);
    bounded = true;
  }
  ops::check_position_range(lo, hi, max_len);
  // A given seq_len (checked for every type, as in the function); else, for a type that
  // scales by length, the longest position just read rather than a second read by the op.
  call.seq_len = where.seq_len().has_value() ? detail::rope_seq_len_argument(parsed.scaling, where.seq_len())
                 : bounded && parsed.seq_len_argument < 0 ? std::max<int64_t>(hi + 1, 0)
                                                          : parsed.seq_len_argument;
  auto out = ops::call_rope(call);
  if (!k.defined()) std::get<1>(out) = torch::Tensor();  // the op's placeholder for no k
  return out;
}

}  // namespace posenc
