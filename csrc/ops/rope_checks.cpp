#include "ops/rope_checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace posenc {
namespace ops {

namespace {

constexpr const char* kLayouts = "'bshd', 'bhsd', 'sbhd' or 'thd'";
constexpr const char* kRopeTypes = "'default', 'linear', 'dynamic', 'yarn' or 'llama3'";
// The names of RopeScaling's fields, in the order of the op's float[] argument.
constexpr const char* kFieldNames[math::kRopeScalingFields] = {
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"};

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

const char* layout_shape(RopeLayout layout) {
  switch (layout) {
    case RopeLayout::kBHSD: return "(batch, heads, seq, head_dim)";
    case RopeLayout::kSBHD: return "(seq, batch, heads, head_dim)";
    case RopeLayout::kTHD: return "(tokens, heads, head_dim)";
    case RopeLayout::kBSHD:
    default: return "(batch, seq, heads, head_dim)";
  }
}

void require_positive(const char* type, const char* key, double value) {
  TORCH_CHECK_VALUE(!math::rope_missing(value), "posenc: rope scaling type '", type,
                    "' needs the key '", key, "', which was not given");
  TORCH_CHECK_VALUE(std::isfinite(value) && value > 0.0, "posenc: expected rope scaling key '",
                    key, "' to be a positive number, got ", value);
}

// A C++ string from a string_view (std::string has no constructor from c10's in older torch).
std::string to_string(c10::string_view s) { return std::string(s.data(), s.size()); }

void check_index_tensor(const char* name, const at::Tensor& t, const at::Tensor& q,
                        bool allow_int32) {
  const bool ok = t.scalar_type() == at::kLong || (allow_int32 && t.scalar_type() == at::kInt);
  TORCH_CHECK_TYPE(ok, "posenc: expected ", name, " to have dtype torch.int64",
                   allow_int32 ? " or torch.int32" : "", ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "posenc: expected ", name, " on q's device ", q.device(),
              ", got ", name, " on ", t.device());
}

int64_t* long_data(const at::Tensor& t) { return t.defined() ? t.data_ptr<int64_t>() : nullptr; }

}  // namespace

RopeLayout parse_rope_layout(c10::string_view layout) {
  if (layout == "bshd") return RopeLayout::kBSHD;
  if (layout == "bhsd") return RopeLayout::kBHSD;
  if (layout == "sbhd") return RopeLayout::kSBHD;
  if (layout == "thd") return RopeLayout::kTHD;
  TORCH_CHECK_VALUE(false, "posenc: unknown layout '", to_string(layout), "'; expected one of ",
                    kLayouts);
}

math::RopeScaling parse_rope_scaling(c10::string_view rope_type, at::ArrayRef<double> fields) {
  math::RopeScaling s;
  if (rope_type == "default") {
    s.type = math::RopeType::kDefault;
  } else if (rope_type == "linear") {
    s.type = math::RopeType::kLinear;
  } else if (rope_type == "dynamic") {
    s.type = math::RopeType::kDynamic;
  } else if (rope_type == "yarn") {
    s.type = math::RopeType::kYarn;
  } else if (rope_type == "llama3") {
    s.type = math::RopeType::kLlama3;
  } else {
    TORCH_CHECK_VALUE(false, "posenc: unknown rope scaling type '", to_string(rope_type),
                      "'; expected one of ", kRopeTypes);
  }
  if (s.type == math::RopeType::kDefault && fields.empty()) return s;
  TORCH_CHECK_VALUE(fields.size() == math::kRopeScalingFields, "posenc: expected ",
                    math::kRopeScalingFields, " rope scaling values (",
                    "factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, "
                    "beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate; "
                    "NaN for a key not given), got ",
                    fields.size());
  double* out[math::kRopeScalingFields] = {
      &s.factor, &s.low_freq_factor, &s.high_freq_factor, &s.original_max_position_embeddings,
      &s.beta_fast, &s.beta_slow, &s.attention_factor, &s.mscale, &s.mscale_all_dim,
      &s.truncate};
  for (int i = 0; i < math::kRopeScalingFields; ++i) {
    TORCH_CHECK_VALUE(math::rope_missing(fields[i]) || std::isfinite(fields[i]),
                      "posenc: expected rope scaling key '", kFieldNames[i],
                      "' to be finite, got ", fields[i]);
    *out[i] = fields[i];
  }
  const std::string type = to_string(rope_type);
  switch (s.type) {
    case math::RopeType::kLinear:
      require_positive(type.c_str(), "factor", s.factor);
      break;
    case math::RopeType::kDynamic:
    case math::RopeType::kYarn:
      require_positive(type.c_str(), "factor", s.factor);
      require_positive(type.c_str(), "original_max_position_embeddings",
                       s.original_max_position_embeddings);
      if (s.type == math::RopeType::kYarn) {
        // Optional (defaults 32 and 1), but a given 0 would put a correction dimension at
        // infinity (Hugging Face reads a 0 as "not given"; here it is an error).
        for (const auto& [key, value] : {std::pair<const char*, double>{"beta_fast", s.beta_fast},
                                         {"beta_slow", s.beta_slow}}) {
          TORCH_CHECK_VALUE(math::rope_missing(value) || (std::isfinite(value) && value > 0.0),
                            "posenc: expected rope scaling key '", key,
                            "' to be a positive number, got ", value);
        }
      }
      break;
    case math::RopeType::kLlama3:
      require_positive(type.c_str(), "factor", s.factor);
      require_positive(type.c_str(), "low_freq_factor", s.low_freq_factor);
      require_positive(type.c_str(), "high_freq_factor", s.high_freq_factor);
      require_positive(type.c_str(), "original_max_position_embeddings",
                       s.original_max_position_embeddings);
      TORCH_CHECK_VALUE(s.high_freq_factor > s.low_freq_factor,
                        "posenc: expected rope scaling key 'high_freq_factor' (",
                        s.high_freq_factor, ") to be greater than 'low_freq_factor' (",
                        s.low_freq_factor, ")");
      break;
    default:
      break;
  }
  return s;
}

at::Tensor rope_canonical_view(const at::Tensor& x, RopeLayout layout) {
  switch (layout) {
    case RopeLayout::kBHSD: return x.transpose(1, 2);
    case RopeLayout::kSBHD: return x.transpose(0, 1);
    case RopeLayout::kTHD: return x.unsqueeze(0);
    case RopeLayout::kBSHD:
    default: return x;
  }
}

RopeLayout check_rope_q(const at::Tensor& q, c10::string_view layout_name) {
  const RopeLayout layout = parse_rope_layout(layout_name);
  const int64_t want_dim = layout == RopeLayout::kTHD ? 3 : 4;
  TORCH_CHECK(q.dim() == want_dim, "posenc: expected q to be a ", want_dim, "-D tensor ",
              layout_shape(layout), " for layout '", to_string(layout_name), "', got shape ",
              q.sym_sizes());
  TORCH_CHECK_TYPE(is_supported_float(q.scalar_type()),
                   "posenc: expected q to have a floating-point dtype (float16, bfloat16, "
                   "float32 or float64), got ",
                   q.scalar_type());
  return layout;
}

void check_rope_indices(const at::Tensor& q, const std::optional<at::Tensor>& positions,
                        const std::optional<at::Tensor>& offsets,
                        const std::optional<at::Tensor>& cu_seqlens,
                        c10::string_view layout_name) {
  const RopeLayout layout = parse_rope_layout(layout_name);
  const at::Tensor qv = rope_canonical_view(q, layout);
  const c10::SymInt batch = qv.sym_size(0);
  const c10::SymInt seq = qv.sym_size(1);
  if (layout == RopeLayout::kTHD) {
    TORCH_CHECK_VALUE(cu_seqlens.has_value(), "posenc: layout 'thd' (packed sequences) needs ",
                      "cu_seqlens, the cumulative sequence lengths [0, len0, len0+len1, ...]");
    TORCH_CHECK_VALUE(!positions.has_value(), "posenc: expected positions=None with layout 'thd' ",
                      "(positions restart at each sequence of cu_seqlens; use offsets to shift "
                      "them)");
  } else {
    TORCH_CHECK_VALUE(!cu_seqlens.has_value(), "posenc: cu_seqlens is only used with layout ",
                      "'thd', got layout '", to_string(layout_name), "'");
  }
  c10::SymInt num_seqs = batch;
  if (cu_seqlens.has_value()) {
    check_index_tensor("cu_seqlens", *cu_seqlens, q, /*allow_int32=*/true);
    TORCH_CHECK(cu_seqlens->dim() == 1 && cu_seqlens->sym_size(0) >= 1,
                "posenc: expected cu_seqlens to be a 1-D tensor [0, ..., tokens] of ",
                "num_sequences + 1 entries, got shape ", cu_seqlens->sym_sizes());
    num_seqs = cu_seqlens->sym_size(0) - 1;
  }
  if (positions.has_value()) {
    check_index_tensor("positions", *positions, q, /*allow_int32=*/false);
    const bool ok = (positions->dim() == 1 && positions->sym_size(0) == seq) ||
                    (positions->dim() == 2 && positions->sym_size(0) == batch &&
                     positions->sym_size(1) == seq);
    TORCH_CHECK(ok, "posenc: expected positions of shape (seq,) = (", seq, ",) or (batch, seq) = (",
                batch, ", ", seq, "), got shape ", positions->sym_sizes());
  }
  if (offsets.has_value()) {
    check_index_tensor("offsets", *offsets, q, /*allow_int32=*/false);
    TORCH_CHECK(offsets->dim() == 1 && offsets->sym_size(0) == num_seqs,
                "posenc: expected offsets of shape (", num_seqs, ",), one per ",
                layout == RopeLayout::kTHD ? "sequence of cu_seqlens" : "batch row",
                ", got shape ", offsets->sym_sizes());
  }
}

int64_t check_rope_structure(const at::Tensor& q, const std::optional<at::Tensor>& k,
                             const std::optional<at::Tensor>& positions,
                             const std::optional<at::Tensor>& offsets,
                             const std::optional<at::Tensor>& cu_seqlens, int64_t rotary_dim,
                             c10::string_view layout_name) {
  const RopeLayout layout = check_rope_q(q, layout_name);
  const at::Tensor qv = rope_canonical_view(q, layout);
  const c10::SymInt head_dim = qv.sym_size(3);
  if (k.has_value()) {
    TORCH_CHECK(k->dim() == q.dim(), "posenc: expected k to be a ", q.dim(), "-D tensor ",
                layout_shape(layout), " for layout '", to_string(layout_name), "', got shape ",
                k->sym_sizes());
    TORCH_CHECK_TYPE(k->scalar_type() == q.scalar_type(), "posenc: expected k to have q's dtype ",
                     q.scalar_type(), ", got ", k->scalar_type());
    TORCH_CHECK(k->device() == q.device(), "posenc: expected k on q's device ", q.device(),
                ", got k on ", k->device());
    const at::Tensor kv = rope_canonical_view(*k, layout);
    TORCH_CHECK(kv.sym_size(3) == head_dim, "posenc: expected q and k to have the same head_dim, ",
                "got q of shape ", q.sym_sizes(), " and k of shape ", k->sym_sizes());
    TORCH_CHECK(kv.sym_size(0) == qv.sym_size(0) && kv.sym_size(1) == qv.sym_size(1),
                "posenc: expected q and k to have the same batch and sequence sizes (they may "
                "differ in heads), got q of shape ",
                q.sym_sizes(), " and k of shape ", k->sym_sizes(), " for layout '",
                to_string(layout_name), "'");
  }
  const int64_t hd = head_dim.guard_int(__FILE__, __LINE__);
  const int64_t rot = rotary_dim < 0 ? hd : rotary_dim;
  TORCH_CHECK_VALUE(rotary_dim == -1 || rotary_dim > 0,
                    "posenc: expected rotary_dim to be a positive even number or None, got ",
                    rotary_dim);
  TORCH_CHECK_VALUE(rot % 2 == 0, "posenc: expected rotary_dim to be even (features rotate in ",
                    "pairs), got ", rot, rotary_dim < 0 ? " (the head_dim of q)" : "");
  TORCH_CHECK_VALUE(rot <= hd, "posenc: expected rotary_dim <= head_dim = ", hd, ", got ", rot);
  TORCH_CHECK_VALUE(rot / 2 <= kMaxRopePairs, "posenc: rotary_dim ", rot, " is not supported; ",
                    "expected at most ", 2 * kMaxRopePairs);

  check_rope_indices(q, positions, offsets, cu_seqlens, layout_name);
  return rot;
}

void check_rope_base(double base) {
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 1.0, "posenc: expected base > 1, got ", base);
}

std::vector<double> rope_frequencies_host(int64_t rotary_dim, double base,
                                          const math::RopeScaling& scaling, int64_t seq_len) {
  TORCH_CHECK_VALUE(rotary_dim > 0 && rotary_dim % 2 == 0,
                    "posenc: expected rotary_dim to be a positive even number, got ", rotary_dim);
  // The kernels hold the frequencies per launch: a module with a larger dim would build
  // and then fail at its first call, so rope_frequencies refuses it too.
  TORCH_CHECK_VALUE(rotary_dim / 2 <= kMaxRopePairs, "posenc: rotary_dim ", rotary_dim,
                    " is not supported; expected at most ", 2 * kMaxRopePairs);
  check_rope_base(base);
  TORCH_CHECK_VALUE(seq_len >= 0, "posenc: expected seq_len >= 0, got ", seq_len);
  std::vector<double> freqs(rotary_dim / 2);
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    freqs[i] = math::rope_inv_freq(i, rotary_dim, base, scaling, seq_len);
    // Each key is checked alone; extreme combinations (a linear factor of 1e-310, a
    // dynamic base beyond float64) could still give inf or 0 frequencies, i.e. NaN or
    // unrotated outputs.
    TORCH_CHECK_VALUE(std::isfinite(freqs[i]) && freqs[i] > 0.0, "posenc: the RoPE settings ",
                      "(base ", base, ", rotary_dim ", rotary_dim, ", the scaling keys, seq_len ",
                      seq_len, ") give inverse frequency ", freqs[i], " for pair ", i,
                      "; expected finite positive frequencies");
  }
  return freqs;
}

namespace {

// True when q and k (canonical (B, S, H, D) views of one storage) provably share no element,
// for the common case that at::get_overlap_status cannot decide: slices of one fused qkv
// buffer, i.e. the same (batch, seq) strides, every (b, s) row starting at a multiple of the
// seq stride, and the two rows' extents disjoint modulo that stride.
bool rows_provably_disjoint(const at::Tensor& q, const at::Tensor& k) {
  if (q.stride(0) != k.stride(0) || q.stride(1) != k.stride(1)) return false;
  const int64_t row = q.stride(1);
  if (row <= 0 || (q.size(0) > 1 && q.stride(0) % row != 0)) return false;
  auto extent = [](const at::Tensor& t) {
    int64_t e = 1;
    for (int d = 2; d < 4; ++d) {
      if (t.stride(d) < 0) return std::numeric_limits<int64_t>::max();
      e += (t.size(d) - 1) * t.stride(d);
    }
    return e;
  };
  const int64_t eq = extent(q), ek = extent(k);
  if (eq > row || ek > row) return false;
  const int64_t oq = q.storage_offset() % row, ok = k.storage_offset() % row;
  // Circular intervals [oq, oq + eq) and [ok, ok + ek) on a circle of length `row`.
  const int64_t dq = ((ok - oq) % row + row) % row;  // where k starts, seen from q
  return dq >= eq && dq + ek <= row;
}

}  // namespace

void check_rope_inplace(const at::Tensor& q, const std::optional<at::Tensor>& k,
                        c10::string_view layout) {
  TORCH_CHECK(at::has_internal_overlap(q) != at::MemOverlap::Yes,
              "posenc: inplace=True needs q without internal overlap (an expanded tensor ",
              "cannot be rotated in place); pass a contiguous copy or use inplace=False");
  if (!k.has_value()) return;
  TORCH_CHECK(at::has_internal_overlap(*k) != at::MemOverlap::Yes,
              "posenc: inplace=True needs k without internal overlap (an expanded tensor ",
              "cannot be rotated in place); pass a contiguous copy or use inplace=False");
  // at::get_overlap_status answers TooHard for any tensor that is not dense before it looks
  // at storages, so two strided views of separate allocations would be refused. Different
  // storages are separate when their bytes are (two storages can wrap one buffer:
  // from_blob, DLPack, numpy); the row-disjointness proof below needs one storage.
  if (q.has_storage() && k->has_storage() && !q.storage().is_alias_of(k->storage())) {
    const auto* q0 = static_cast<const char*>(q.storage().data());
    const auto* k0 = static_cast<const char*>(k->storage().data());
    const bool disjoint = q0 + q.storage().nbytes() <= k0 || k0 + k->storage().nbytes() <= q0;
    TORCH_CHECK(disjoint, "posenc: inplace=True needs q and k in separate memory, got two ",
                "storages over overlapping memory; use inplace=False");
    return;
  }
  const auto overlap = at::get_overlap_status(q, *k);
  bool separate = overlap == at::MemOverlapStatus::No;
  if (overlap == at::MemOverlapStatus::TooHard) {
    const RopeLayout l = parse_rope_layout(layout);
    separate = rows_provably_disjoint(rope_canonical_view(q, l), rope_canonical_view(*k, l));
  }
  TORCH_CHECK(separate, "posenc: inplace=True needs q and k in separate memory, got ",
              overlap == at::MemOverlapStatus::TooHard ? "views whose separation cannot be proven"
                                                       : "overlapping tensors",
              "; use inplace=False");
}

namespace {

// Everything a kernel launch needs, for inputs that passed check_rope_structure (rot is its
// resolved rotary_dim): the frequencies of the call, the canonical views' pointers and
// strides, and value checks of CPU cu_seqlens (CUDA ones would cost a sync: the kernels
// mark tokens outside every packed sequence with NaN instead). out_q/out_k: where the
// kernel writes (the inputs themselves in place).
RopeLaunch prepare_rope_launch(const at::Tensor& q, const std::optional<at::Tensor>& k,
                               const std::optional<at::Tensor>& positions,
                               const std::optional<at::Tensor>& offsets, int64_t offset,
                               const std::optional<at::Tensor>& cu_seqlens, double base,
                               c10::string_view rope_type, at::ArrayRef<double> scaling,
                               int64_t seq_len, int64_t rot, bool interleaved,
                               c10::string_view layout_name, bool inverse,
                               const at::Tensor& out_q, const std::optional<at::Tensor>& out_k) {
  const math::RopeScaling s = parse_rope_scaling(rope_type, scaling);
  const RopeLayout layout = parse_rope_layout(layout_name);
  check_rope_position_value("offset", offset);
  if (s.type == math::RopeType::kDynamic && seq_len < 0) {
    // The longest position of the call + 1 (0 when it rotates nothing).
    seq_len = std::get<1>(rope_position_bounds_unchecked(q, positions, offsets, offset,
                                                         cu_seqlens, layout)) + 1;
  }
  const std::vector<double> freqs = rope_frequencies_host(rot, base, s, std::max<int64_t>(seq_len, 0));

  RopeLaunch launch;
  RopeArgs& a = launch.args;
  const at::Tensor qv = rope_canonical_view(q, layout);
  a.batch = qv.size(0);
  a.seq = qv.size(1);
  a.head_dim = qv.size(3);
  a.rotary_dim = rot;
  a.interleaved = interleaved;
  a.inverse = inverse;
  a.offset = offset;
  a.attention_factor = math::rope_attention_factor(s);
  for (size_t i = 0; i < freqs.size(); ++i) a.inv_freq[i] = freqs[i];

  auto fill = [&](RopeOperand& op, const at::Tensor& in, const at::Tensor& out) {
    const at::Tensor iv = rope_canonical_view(in, layout);
    const at::Tensor ov = rope_canonical_view(out, layout);
    op.in = iv.const_data_ptr();
    op.out = ov.mutable_data_ptr();
    op.heads = iv.size(2);
    for (int d = 0; d < 4; ++d) {
      op.in_stride[d] = iv.stride(d);
      op.out_stride[d] = ov.stride(d);
    }
  };
  fill(a.q, q, out_q);
  if (k.has_value()) fill(a.k, *k, *out_k);

  if (positions.has_value()) {
    launch.positions = positions->contiguous();
    a.positions = long_data(launch.positions);
    a.positions_batch_stride = positions->dim() == 2 ? a.seq : 0;
  }
  if (offsets.has_value()) {
    launch.offsets = offsets->contiguous();
    a.offsets = long_data(launch.offsets);
  }
  // CPU index values are checked against the position domain here, where reading them is
  // a pass over a few integers per token: a huge one would wrap the int64 sum silently.
  // (CUDA ones are read only where a sync is paid anyway: the module, "dynamic".)
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"positions", &launch.positions},
                                {"offsets", &launch.offsets}}) {
    if (!t->defined() || !t->is_cpu()) continue;
    const int64_t* v = t->const_data_ptr<int64_t>();
    for (int64_t i = 0, n = t->numel(); i < n; ++i) check_rope_position_value(name, v[i]);
  }
  if (cu_seqlens.has_value()) {
    launch.cu_seqlens = cu_seqlens->to(at::kLong).contiguous();
    a.cu_seqlens = long_data(launch.cu_seqlens);
    a.num_seqs = launch.cu_seqlens.size(0) - 1;
    if (launch.cu_seqlens.is_cpu()) {
      const int64_t* cu = a.cu_seqlens;
      bool ok = cu[0] == 0 && cu[a.num_seqs] == a.seq;
      for (int64_t j = 0; ok && j < a.num_seqs; ++j) ok = cu[j] <= cu[j + 1];
      if (!ok) {
        std::ostringstream values;
        const int64_t shown = std::min<int64_t>(a.num_seqs + 1, 16);
        for (int64_t j = 0; j < shown; ++j) values << (j ? ", " : "") << cu[j];
        if (shown < a.num_seqs + 1) values << ", ...";
        TORCH_CHECK_VALUE(false, "posenc: expected cu_seqlens to start at 0, never decrease and ",
                          "end at the number of tokens ", a.seq, ", got [", values.str(), "]");
      }
    }
  }
  return launch;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope_out_of_place(
    const at::Tensor& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
    int64_t offset, const std::optional<at::Tensor>& cu_seqlens, double base,
    c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
    int64_t rotary_dim, bool interleaved, c10::string_view layout, bool inverse,
    RopeOutputAllocator allocate, RopeKernelRunner run) {
  const int64_t rot =
      check_rope_structure(q, k, positions, offsets, cu_seqlens, rotary_dim, layout);
  at::Tensor out_q = allocate(q);
  std::optional<at::Tensor> out_k;
  if (k.has_value()) out_k = allocate(*k);
  const RopeLaunch launch =
      prepare_rope_launch(q, k, positions, offsets, offset, cu_seqlens, base, rope_type, scaling,
                          seq_len, rot, interleaved, layout, inverse, out_q, out_k);
  run(launch, q);
  return {out_q, out_k.has_value() ? *out_k : at::empty({0}, q.options())};
}

void rope_in_place(const at::Tensor& q, const std::optional<at::Tensor>& k,
                   const std::optional<at::Tensor>& positions,
                   const std::optional<at::Tensor>& offsets, int64_t offset,
                   const std::optional<at::Tensor>& cu_seqlens, double base,
                   c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
                   int64_t rotary_dim, bool interleaved, c10::string_view layout, bool inverse,
                   RopeKernelRunner run) {
  const int64_t rot =
      check_rope_structure(q, k, positions, offsets, cu_seqlens, rotary_dim, layout);
  check_rope_inplace(q, k, layout);
  const RopeLaunch launch =
      prepare_rope_launch(q, k, positions, offsets, offset, cu_seqlens, base, rope_type, scaling,
                          seq_len, rot, interleaved, layout, inverse, q, k);
  run(launch, q);
}

}  // namespace ops
}  // namespace posenc
