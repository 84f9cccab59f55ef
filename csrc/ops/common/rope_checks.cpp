#include "ops/common/rope_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "ops/common/float_types.h"
#include "ops/common/py_format.h"

namespace posenc {
namespace ops {
namespace {

const char* layout_shape(RopeLayout layout) {
  switch (layout) {
    case RopeLayout::kBHSD: return "(batch, heads, seq, head_dim)";
    case RopeLayout::kSBHD: return "(seq, batch, heads, head_dim)";
    case RopeLayout::kTHD: return "(tokens, heads, head_dim)";
    case RopeLayout::kBSHD:
    default: return "(batch, seq, heads, head_dim)";
  }
}

// A key the type needs, which the dict did not give.
void require_given(const math::RopeScalingParams& s, math::RopeKey k, const char* key) {
  TORCH_CHECK_VALUE(math::rope_has(s, k), "posenc: rope scaling type '", rope_type_name(s.type),
                    "' needs the key '", key, "', which was not given");
}

void require_positive(const math::RopeScalingParams& s, math::RopeKey k, const char* key,
                      double value) {
  require_given(s, k, key);
  TORCH_CHECK_VALUE(std::isfinite(value) && value > 0.0, "posenc: expected rope scaling key '",
                    key, "' to be a positive number, got ", value);
}

void check_index_tensor(const char* name, const at::Tensor& t, const at::Tensor& q,
                        bool allow_int32) {
  const bool ok = t.scalar_type() == at::kLong || (allow_int32 && t.scalar_type() == at::kInt);
  TORCH_CHECK_TYPE(ok, "posenc: expected ", name, " to have dtype torch.int64",
                   allow_int32 ? " or torch.int32" : "", ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "posenc: expected ", name, " on q's device ", q.device(),
              ", got ", name, " on ", t.device());
}

void check_positions_shape(const RopeCall& c, const c10::SymInt& batch, const c10::SymInt& seq) {
  const at::Tensor& p = *c.positions;
  if (!c.multi_axis()) {
    // (1, seq): Hugging Face's position_ids of one sequence, shared by the batch rows.
    const bool ok = (p.dim() == 1 && p.sym_size(0) == seq) ||
                    (p.dim() == 2 && (p.sym_size(0) == batch || p.sym_size(0) == 1) &&
                     p.sym_size(1) == seq);
    TORCH_CHECK(ok, "posenc: expected positions of shape (seq,) = (", seq, ",) or (batch, seq) = (",
                batch, ", ", seq, "), got shape ", p.sym_sizes(), " ((1, seq) serves every row; ",
                "coordinates of several axes need sections=[...])");
    return;
  }
  const int64_t axes = c.n_axes();
  const bool thd = c.layout == RopeLayout::kTHD;
  const bool ok = p.dim() >= 1 && p.sym_size(0) == axes &&
                  ((p.dim() == 2 && p.sym_size(1) == seq) ||
                   (!thd && p.dim() == 3 && (p.sym_size(1) == batch || p.sym_size(1) == 1) &&
                    p.sym_size(2) == seq));
  if (thd) {
    TORCH_CHECK(ok, "posenc: expected positions of shape (n_axes, tokens) = (", axes, ", ", seq,
                ") for layout 'thd' with ", axes, " sections, got shape ", p.sym_sizes());
  } else {
    TORCH_CHECK(ok, "posenc: expected positions of shape (n_axes, seq) = (", axes, ", ", seq,
                ") or (n_axes, batch, seq) = (", axes, ", ", batch, ", ", seq, ") or (n_axes, 1, seq) for ", axes,
                " sections (one axis each), got shape ", p.sym_sizes());
  }
}

// One message for a section that is not a positive number of rotary pairs (or more than the
// rotary part holds).
void check_section(bool ok, c10::IntArrayRef sections) {
  TORCH_CHECK_VALUE(ok, "posenc: expected every section to be a positive number of rotary pairs, got sections=",
                    sections);
}

}  // namespace

void check_rope_base(double base) {
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 1.0, "posenc: expected base > 1, got ", base);
}

void check_rope_rotary_dim_supported(int64_t rotary_dim) {
  TORCH_CHECK_VALUE(rotary_dim / 2 <= kMaxRopePairs, "posenc: rotary_dim ", rotary_dim,
                    " is not supported; expected at most ", 2 * kMaxRopePairs);
}

void check_rope_position_value(const char* what, int64_t value) {
  TORCH_CHECK_VALUE(value >= -kRopeMaxPosition && value <= kRopeMaxPosition, "posenc: expected ",
                    what, " within " POSENC_ROPE_POSITION_RANGE " (integers exact in the float64 angle), got ",
                    value);
}

void check_rope_scaling(const math::RopeScalingParams& s) {
  switch (s.type) {
    case math::RopeType::kLinear:
      require_positive(s, math::RopeKey::factor, "factor", s.factor);
      break;
    case math::RopeType::kDynamic:
    case math::RopeType::kYarn:
      require_positive(s, math::RopeKey::factor, "factor", s.factor);
      require_positive(s, math::RopeKey::original_max_position_embeddings, "original_max_position_embeddings", s.original_max_position_embeddings);
      if (s.type == math::RopeType::kYarn) {
        // Optional (defaults 32 and 1), but a given 0 would put a correction dimension at
        // infinity (Hugging Face reads a 0 as "not given"; here it is an error).
        if (math::rope_has(s, math::RopeKey::attention_factor)) {
          require_positive(s, math::RopeKey::attention_factor, "attention_factor", s.attention_factor);
        }
        for (const auto& [k, key, value] :
             {std::tuple<math::RopeKey, const char*, double>{math::RopeKey::beta_fast, "beta_fast",
                                                             s.beta_fast},
              {math::RopeKey::beta_slow, "beta_slow", s.beta_slow}}) {
          TORCH_CHECK_VALUE(!math::rope_has(s, k) || (std::isfinite(value) && value > 0.0),
                            "posenc: expected rope scaling key '", key,
                            "' to be a positive number, got ", value);
        }
      }
      break;
    case math::RopeType::kLlama3:
      require_positive(s, math::RopeKey::factor, "factor", s.factor);
      require_positive(s, math::RopeKey::low_freq_factor, "low_freq_factor", s.low_freq_factor);
      require_positive(s, math::RopeKey::high_freq_factor, "high_freq_factor", s.high_freq_factor);
      require_positive(s, math::RopeKey::original_max_position_embeddings, "original_max_position_embeddings", s.original_max_position_embeddings);
      TORCH_CHECK_VALUE(s.high_freq_factor > s.low_freq_factor,
                        "posenc: expected rope scaling key 'high_freq_factor' (",
                        s.high_freq_factor, ") to be greater than 'low_freq_factor' (",
                        s.low_freq_factor, ")");
      break;
    case math::RopeType::kLongrope:
      require_positive(s, math::RopeKey::original_max_position_embeddings, "original_max_position_embeddings", s.original_max_position_embeddings);
      // transformers takes factor from the config (max_position_embeddings / original);
      // the dict alone may lack it: then attention_factor must be given.
      TORCH_CHECK_VALUE(math::rope_has(s, math::RopeKey::factor) || math::rope_has(s, math::RopeKey::attention_factor),
                        "posenc: rope scaling type 'longrope' needs 'factor' (max_position_embeddings"
                        " / original_max_position_embeddings) or 'attention_factor', got neither");
      if (math::rope_has(s, math::RopeKey::factor)) require_positive(s, math::RopeKey::factor, "factor", s.factor);
      if (math::rope_has(s, math::RopeKey::attention_factor)) {
        require_positive(s, math::RopeKey::attention_factor, "attention_factor", s.attention_factor);
      }
      for (int64_t i = 0; i < s.list_length; ++i) {
        TORCH_CHECK_VALUE(s.short_factor[i] > 0.0 && s.long_factor[i] > 0.0,
                          "posenc: expected rope scaling keys 'short_factor' and 'long_factor' to "
                          "hold positive numbers, got ", s.short_factor[i], " and ", s.long_factor[i],
                          " at index ", i);
      }
      break;
    case math::RopeType::kProportional:
      // Optional (default 1.0: every pair turns), as transformers reads it.
      TORCH_CHECK_VALUE(!math::rope_has(s, math::RopeKey::partial_rotary_factor) ||
                            (s.partial_rotary_factor > 0.0 && s.partial_rotary_factor <= 1.0),
                        "posenc: expected rope scaling key 'partial_rotary_factor' in (0, 1] for "
                        "rope_type 'proportional', got ", s.partial_rotary_factor);
      if (math::rope_has(s, math::RopeKey::factor)) require_positive(s, math::RopeKey::factor, "factor", s.factor);
      break;
    default:
      break;
  }
  // The factor cos and sin are multiplied by (yarn's, longrope's), from the keys above: one
  // that is not a positive float32 number (longrope's default with
  // original_max_position_embeddings <= 1, yarn's mscale ratio over a zero) would make the
  // outputs inf or NaN.
  const double attention = math::rope_attention_factor(s);
  TORCH_CHECK_VALUE(attention > 0.0 && std::isfinite(static_cast<float>(attention)),
                    "posenc: expected the rope scaling's attention factor (given as 'attention_factor', or "
                    "computed from 'factor', 'original_max_position_embeddings', 'mscale', 'mscale_all_dim') to be "
                    "a positive finite float32 number, got ", py_float(attention));
}

void check_rope_scaling_lists(const math::RopeScalingParams& s, int64_t rotary_dim,
                              bool multi_axis) {
  if (s.type != math::RopeType::kLongrope) return;
  TORCH_CHECK_VALUE(s.list_length == rotary_dim / 2,
                    "posenc: expected rope scaling keys 'short_factor' and 'long_factor' to hold "
                    "rotary_dim / 2 = ", rotary_dim / 2, " values each, got ", s.list_length);
  TORCH_CHECK_VALUE(!multi_axis, "posenc: rope scaling type 'longrope' is for one position axis; "
                    "got sections (multi-axis RoPE)");
}

void check_rope_sections(const std::vector<int64_t>& sections, math::RopeSectionsMode mode,
                         int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  if (sections.empty()) {
    TORCH_CHECK_VALUE(mode == math::RopeSectionsMode::kAxial, "posenc: sections_mode '",
                      mode == math::RopeSectionsMode::kMrope ? "mrope" : "mrope_interleaved",
                      "' needs sections=[pairs per axis, ...], got none");
    return;
  }
  const int64_t n = static_cast<int64_t>(sections.size());
  TORCH_CHECK_VALUE(n <= math::kRopeMaxAxes, "posenc: expected at most ", math::kRopeMaxAxes,
                    " sections (one per position axis), got ", n, ": ", c10::IntArrayRef(sections));
  int64_t sum = 0;
  for (const int64_t s : sections) {
    check_section(s > 0 && s <= half, sections);
    sum += s;
  }
  TORCH_CHECK_VALUE(sum == half, "posenc: expected sections (rotary pairs per axis) to sum to "
                    "rotary_dim / 2 = ", half, ", got sections=", c10::IntArrayRef(sections),
                    " summing to ", sum, " (Qwen2-VL's mrope_section counts pairs: [16, 24, 24] "
                    "for head_dim 128; FLUX's axes_dim counts features: halve it)");
  if (mode == math::RopeSectionsMode::kMropeInterleaved) {
    // Axis a >= 1 turns pairs a, a + n, ..., a + n (sections[a] - 1) (transformers' Qwen3-VL
    // slice(a, n * sections[a], n)); the last of them must exist.
    for (int64_t a = 1; a < n; ++a) {
      TORCH_CHECK_VALUE(a + n * (sections[a] - 1) < half, "posenc: sections_mode 'mrope_interleaved' ",
                        "gives axis ", a, " every ", n, "-th pair from pair ", a, ", ", sections[a],
                        " of them up to pair ", a + n * (sections[a] - 1), ", but there are only ", half,
                        " pairs; got sections=", c10::IntArrayRef(sections));
    }
  }
}

void check_rope_indices(const RopeCall& c) {
  const at::Tensor qv = rope_canonical_view(c.q, c.layout);
  const c10::SymInt batch = qv.sym_size(0);
  const c10::SymInt seq = qv.sym_size(1);
  if (c.layout == RopeLayout::kTHD) {
    TORCH_CHECK_VALUE(c.cu_seqlens.has_value(), "posenc: layout 'thd' (packed sequences) needs ",
                      "cu_seqlens, the cumulative sequence lengths [0, len0, len0+len1, ...]");
    TORCH_CHECK_VALUE(!c.positions.has_value() || c.multi_axis(),
                      "posenc: expected positions=None with layout 'thd' (positions restart at "
                      "each sequence of cu_seqlens; use offsets to shift them)");
  } else {
    TORCH_CHECK_VALUE(!c.cu_seqlens.has_value(), "posenc: cu_seqlens is only used with layout ",
                      "'thd', got layout '", rope_layout_name(c.layout), "'");
  }
  c10::SymInt num_seqs = batch;
  if (c.cu_seqlens.has_value()) {
    check_index_tensor("cu_seqlens", *c.cu_seqlens, c.q, /*allow_int32=*/true);
    TORCH_CHECK(c.cu_seqlens->dim() == 1 && c.cu_seqlens->sym_size(0) >= 1,
                "posenc: expected cu_seqlens to be a 1-D tensor [0, ..., tokens] of ",
                "num_sequences + 1 entries, got shape ", c.cu_seqlens->sym_sizes());
    num_seqs = c.cu_seqlens->sym_size(0) - 1;
  }
  if (c.positions.has_value()) {
    check_index_tensor("positions", *c.positions, c.q, /*allow_int32=*/false);
    check_positions_shape(c, batch, seq);
  }
  if (c.offsets.has_value()) {
    check_index_tensor("offsets", *c.offsets, c.q, /*allow_int32=*/false);
    TORCH_CHECK(c.offsets->dim() == 1 && c.offsets->sym_size(0) == num_seqs,
                "posenc: expected offsets of shape (", num_seqs, ",), one per ",
                c.layout == RopeLayout::kTHD ? "sequence of cu_seqlens" : "batch row",
                ", got shape ", c.offsets->sym_sizes());
  }
}

int64_t check_rope_structure(const RopeCall& c) {
  const at::Tensor& q = c.q;
  const int64_t want_dim = c.layout == RopeLayout::kTHD ? 3 : 4;
  const char* layout = rope_layout_name(c.layout);
  TORCH_CHECK(q.dim() == want_dim, "posenc: expected q to be a ", want_dim, "-D tensor ",
              layout_shape(c.layout), " for layout '", layout, "', got shape ", q.sym_sizes());
  TORCH_CHECK_TYPE(is_supported_float(q.scalar_type()),
                   "posenc: expected q to have a floating-point dtype (float16, bfloat16, "
                   "float32 or float64), got ",
                   q.scalar_type());
  const at::Tensor qv = rope_canonical_view(q, c.layout);
  if (c.k.has_value()) {
    const at::Tensor& k = *c.k;
    TORCH_CHECK(k.dim() == q.dim(), "posenc: expected k to be a ", q.dim(), "-D tensor ",
                layout_shape(c.layout), " for layout '", layout, "', got shape ", k.sym_sizes());
    TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "posenc: expected k to have q's dtype ",
                     q.scalar_type(), ", got ", k.scalar_type());
    TORCH_CHECK(k.device() == q.device(), "posenc: expected k on q's device ", q.device(),
                ", got k on ", k.device());
    const at::Tensor kv = rope_canonical_view(k, c.layout);
    TORCH_CHECK(kv.sym_size(3) == qv.sym_size(3), "posenc: expected q and k to have the same ",
                "head_dim, got q of shape ", q.sym_sizes(), " and k of shape ", k.sym_sizes());
    TORCH_CHECK(kv.sym_size(0) == qv.sym_size(0) && kv.sym_size(1) == qv.sym_size(1),
                "posenc: expected q and k to have the same batch and sequence sizes (they may "
                "differ in heads), got q of shape ",
                q.sym_sizes(), " and k of shape ", k.sym_sizes(), " for layout '", layout, "'");
  }
  const int64_t hd = qv.sym_size(3).guard_int(__FILE__, __LINE__);
  // Where the rotary part starts (math::rope_rotary_begin): by default it runs to the end
  // of the head.
  const int64_t begin = math::rope_rotary_begin(c.settings);
  TORCH_CHECK_VALUE(begin == 0 || (begin > 0 && begin < hd),
                    "posenc: expected the rotary part to start inside the head, at a feature in "
                    "[0, head_dim = ", hd, "), got ", begin);
  // The rotary width (the one statement of its rule; the modules ask the op
  // rope_rotary_width): rotary_dim; by default the rest of the head from begin, or with
  // sections what they rotate, 2 * sum(sections).
  int64_t rot = c.rotary_dim < 0 ? hd - begin : c.rotary_dim;
  if (c.rotary_dim < 0 && c.multi_axis()) {
    rot = 0;
    // Each positive before the width is named (sections=[-1, 5] was "at most 4 pairs"), and
    // at most head_dim (a larger one fails the width check below: no sum past int64).
    for (const int64_t s : c.sections) {
      check_section(s > 0, c.sections);
      rot += 2 * std::min<int64_t>(s, hd);
    }
  }
  TORCH_CHECK_VALUE(c.rotary_dim == -1 || c.rotary_dim > 0,
                    "posenc: expected rotary_dim to be a positive even number or None, got ",
                    c.rotary_dim);
  // Without rotary_dim, the width the heads leave (named by what the op's caller passed: q's or
  // a cache's heads, past rotary_offset).
  TORCH_CHECK_VALUE(rot % 2 == 0, "posenc: expected rotary_dim to be even (features rotate in ",
                    "pairs), got ", rot,
                    c.rotary_dim >= 0 ? std::string()
                    : begin > 0       ? c10::str(" (head_dim ", hd, " - rotary_offset ", begin, ")")
                                      : std::string(" (the heads' head_dim)"));
  // Without rotary_dim, sections set the width: name the argument the caller passed.
  TORCH_CHECK_VALUE(rot <= hd || c.rotary_dim >= 0 || !c.multi_axis(),
                    "posenc: expected sections to hold at most head_dim / 2 = ", hd / 2,
                    " rotary pairs, got sections=", c10::IntArrayRef(c.sections), " (", rot / 2,
                    " pairs)");
  TORCH_CHECK_VALUE(rot <= hd, "posenc: expected rotary_dim <= head_dim = ", hd, ", got ", rot);
  TORCH_CHECK_VALUE(begin + rot <= hd, "posenc: expected the rotary features [", begin, ", ",
                    begin + rot, ") (rotary_dim ", rot, " from feature ", begin,
                    ") within head_dim = ", hd);
  // "proportional" (Gemma 4) turns a share of the pairs of the whole head, its exponents
  // over head_dim (transformers' _compute_proportional_rope_parameters): a rotary part
  // narrower than the head would take them over its own width, a configuration no model has
  // and two readings of, so it is refused rather than guessed.
  TORCH_CHECK_VALUE(c.scaling.type != math::RopeType::kProportional || (begin == 0 && rot == hd),
                    "posenc: rope_type 'proportional' turns pairs of the whole head (its "
                    "partial_rotary_factor says how many): expected the rotary part to be the head, "
                    "features [0, head_dim = ", hd, "), got [", begin, ", ", begin + rot,
                    ") (leave rotary_dim, rotary_offset and sections unset)");
  check_rope_rotary_dim_supported(rot);
  check_rope_sections(c.sections, c.sections_mode, rot);
  check_rope_scaling_lists(c.scaling, rot, c.multi_axis());
  check_rope_indices(c);
  return rot;
}

void check_rope_settings(const RopeCall& c) {
  check_rope_base(c.base);
  check_rope_scaling(c.scaling);
  if (const auto v = c.offset.maybe_as_int()) check_rope_position_value("offset", *v);
  if (const auto v = c.seq_len.maybe_as_int()) {
    TORCH_CHECK_VALUE(*v >= -1, "posenc: expected seq_len >= 0 (or -1: from the call), got ", *v);
  }
}

}  // namespace ops
}  // namespace posenc
