// rope_shift_kv_, the whole op but its kernels (cpu/kernel.cpp, cuda/rope_shift_kv/): the
// schema (RoPE's configuration cut from its schema tail), the reader of a boxed call, the
// argument checks, the launch preparation every backend shares, the Autograd kernel (which
// refuses inputs that require grad), the Meta kernel, the ATen composite and the CPU and
// CUDA registrations.
#include "ops/rope_shift_kv/rope_shift_kv.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ops/common/aten_fallback.h"
#include "ops/common/float_types.h"
#include "ops/common/op_handles.h"
#include "ops/common/inference_only.h"
#include "ops/common/meta_support.h"
#include "ops/common/rope_checks.h"
#include "ops/rope_append_kv/rope_append_kv.h"  // kv_cache_format: the FP8 caches' rule

namespace posenc {
namespace ops {

// ---- The schema and the call's reader and writer

namespace {

constexpr const char* kOp = "rope_shift_kv";

// The arguments before RoPE's configuration: k_cache, from_positions, to_positions, rows,
// slot_mapping, k_scale, from_seq_len, to_seq_len.
constexpr size_t kOwnArguments = 8;

// The arguments of RoPE's tail (RopeCall::for_each_argument) that this op does not take, each
// with the value its RopeCall gets: one rotation's tensors and positions, its seq_len, and the
// direction (a shift goes from one angle to another).
bool unused_rope_argument(const char* name) {
  static const char* const kUnused[] = {"q", "k", "positions", "offsets", "offset",
                                        "cu_seqlens", "seq_len", "inverse"};
  for (const char* u : kUnused) {
    if (std::strcmp(u, name) == 0) return true;
  }
  return false;
}

c10::IValue unused_rope_value(const char* name, const at::Tensor& like) {
  if (std::strcmp(name, "q") == 0) return like;
  if (std::strcmp(name, "offset") == 0 || std::strcmp(name, "seq_len") == 0) return int64_t{0};
  if (std::strcmp(name, "inverse") == 0) return false;
  return c10::IValue();  // None
}

// The configuration's argument names, in schema order.
const std::vector<std::string>& config_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    RopeCall c;
    RopeCall::for_each_argument(c, [&](const char* name, auto&) {
      if (!unused_rope_argument(name)) out.emplace_back(name);
    });
    return out;
  }();
  return names;
}

// The configuration's part of kRopeSchemaArguments ("float base=10000.0, ..."): the tail's
// arguments (split at top-level commas) whose names config_names lists.
std::string config_schema() {
  const std::string tail = kRopeSchemaArguments;
  std::vector<std::string> parts;
  int depth = 0;
  std::string cur;
  for (const char ch : tail) {
    if (ch == '[' || ch == '(') ++depth;
    if (ch == ']' || ch == ')') --depth;
    if (ch == ',' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
      continue;
    }
    cur += ch;
  }
  parts.push_back(cur);
  std::string out;
  size_t kept = 0;
  for (std::string p : parts) {
    p.erase(0, p.find_first_not_of(' '));
    const size_t eq = p.find('=');
    const std::string decl = p.substr(0, eq);
    const std::string name = decl.substr(decl.find_last_of(' ') + 1);
    if (unused_rope_argument(name.c_str())) continue;
    out += (kept++ ? ", " : "") + p;
  }
  TORCH_INTERNAL_ASSERT(kept == config_names().size(), "posenc: rope_shift_kv_: kept ", kept,
                        " of RoPE's schema arguments, RopeCall has ", config_names().size());
  return out;
}

std::optional<c10::SymInt> optional_symint(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::optional<c10::SymInt>(v.toSymInt());
}
c10::IValue optional_ivalue(const std::optional<c10::SymInt>& v) {
  return v.has_value() ? c10::IValue(*v) : c10::IValue();
}

}  // namespace

RopeShiftKvCall RopeShiftKvCall::pop(torch::jit::Stack& stack) {
  static const size_t n_config = config_names().size();
  const size_t n = kOwnArguments + n_config;
  TORCH_INTERNAL_ASSERT(stack.size() >= n, "posenc: rope_shift_kv_ call with ", stack.size(),
                        " arguments on the stack, expected ", n);
  const size_t first = stack.size() - n;
  RopeShiftKvCall c;
  c.k_cache = stack[first].toTensor();
  c.from_positions = stack[first + 1].toTensor();
  c.to_positions = stack[first + 2].toTensor();
  // Named here: RoPE's reader below takes k_cache as its q.
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"k_cache", &c.k_cache},
                                {"from_positions", &c.from_positions}, {"to_positions", &c.to_positions}}) {
    TORCH_CHECK_VALUE(t->defined(), "posenc: rope_shift_kv: expected ", name, " to be a tensor, got an undefined "
                      "tensor");
  }
  c.rows = optional_tensor(stack[first + 3]);
  c.slot_mapping = optional_tensor(stack[first + 4]);
  c.k_scale = optional_tensor(stack[first + 5]);
  c.from_seq_len = optional_symint(stack[first + 6]);
  c.to_seq_len = optional_symint(stack[first + 7]);
  // The configuration through RoPE's own reader: the whole tail, the unused arguments at
  // their values.
  torch::jit::Stack rope;
  size_t i = first + kOwnArguments;
  RopeCall::for_each_argument(c.config, [&](const char* name, auto&) {
    rope.push_back(unused_rope_argument(name) ? unused_rope_value(name, c.k_cache) : stack[i++]);
  });
  c.config = RopeCall::pop(rope);
  torch::jit::drop(stack, n);
  return c;
}

void RopeShiftKvCall::push(torch::jit::Stack& stack) const {
  stack.insert(stack.end(), {k_cache, from_positions, to_positions, optional_tensor_ivalue(rows),
                             optional_tensor_ivalue(slot_mapping), optional_tensor_ivalue(k_scale),
                             optional_ivalue(from_seq_len), optional_ivalue(to_seq_len)});
  RopeCall c = config;
  c.q = k_cache;
  torch::jit::Stack rope;
  c.push(rope);
  size_t i = 0;
  RopeCall::for_each_argument(c, [&](const char* name, auto&) {
    if (!unused_rope_argument(name)) stack.push_back(rope[i]);
    ++i;
  });
}

int64_t RopeShiftKvCall::batch() const { return paged() ? 1 : k_cache.size(0); }
int64_t RopeShiftKvCall::n() const { return from_positions.size(-1); }

RopeCall RopeShiftKvCall::end(bool to) const {
  RopeCall r = config;
  const at::Tensor cv = kv_cache_view(k_cache, config.layout);
  const c10::SymInt batch = paged() ? c10::SymInt(1) : cv.sym_size(0);
  const at::ScalarType dtype = is_supported_float(k_cache.scalar_type()) ? k_cache.scalar_type() : at::kFloat;
  // A stand-in q of the items' shape without memory (one element, expanded): RoPE's checks
  // and launch read its sizes, never its values (so not filled: a kernel launch on CUDA).
  r.q = k_cache.new_empty({1, 1, 1, 1}, at::TensorOptions(dtype))
            .expand_symint({batch, from_positions.sym_size(-1), cv.sym_size(2), cv.sym_size(3)});
  r.k = std::nullopt;
  r.layout = RopeLayout::kBSHD;
  r.positions = to ? to_positions : from_positions;
  const std::optional<c10::SymInt>& seq_len = to ? to_seq_len : from_seq_len;
  if (seq_len.has_value()) {
    r.seq_len = *seq_len;  // symbolic under torch.compile: RopeCall's seq_len is a SymInt
  } else {
    r.seq_len = math::rope_scales_by_length(config.scaling.type) ? -1 : 0;
  }
  return r;
}

void call_rope_shift_kv(const RopeShiftKvCall& c) {
  static const c10::OperatorHandle op = find_boxed_op("posenc::rope_shift_kv_");
  torch::jit::Stack stack;
  c.push(stack);
  op.callBoxed(stack);
}

// ---- Checks (each message names the argument)

namespace {

const char* cache_shape(RopeLayout layout) {
  switch (layout) {
    case RopeLayout::kBHSD: return "(batch, kv_heads, max_len, head_dim)";
    case RopeLayout::kTHD: return "(num_blocks, block_size, kv_heads, head_dim)";
    default: return "(batch, max_len, kv_heads, head_dim)";
  }
}

void check_index(const char* name, const at::Tensor& t, const at::Tensor& cache) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "posenc: rope_shift_kv: expected ", name,
                   " to have dtype torch.int64, got ", t.scalar_type());
  TORCH_CHECK(t.device() == cache.device(), "posenc: rope_shift_kv: expected ", name,
              " on k_cache's device ", cache.device(), ", got ", name, " on ", t.device());
}

// Positions of one end: (n,) or (batch, n) ((1, n) shared), with sections (n_axes, n) or
// (n_axes, batch, n); paged: (n,) or (n_axes, n).
void check_positions(const char* name, const at::Tensor& p, const c10::SymInt& batch,
                     const c10::SymInt& n, int64_t axes, bool paged) {
  const int64_t lead = axes > 1 ? 1 : 0;
  const bool axes_ok = lead == 0 || (p.dim() >= 1 && p.sym_size(0) == axes);
  const int64_t d = p.dim() - lead;
  const bool ok = p.dim() >= 1 + lead && axes_ok && p.sym_size(-1) == n &&
                  (d == 1 || (!paged && d == 2 && (p.sym_size(lead) == batch || p.sym_size(lead) == 1)));
  if (axes > 1) {
    TORCH_CHECK(ok, "posenc: rope_shift_kv: expected ", name, " of shape (n_axes, n) = (", axes, ", ",
                n, ")", paged ? "" : " or (n_axes, batch, n)", " for ", axes,
                " sections (one axis each), got shape ", p.sym_sizes());
  } else if (paged) {
    TORCH_CHECK(ok, "posenc: rope_shift_kv: expected ", name, " of shape (n,) = (", n,
                ",), one position per slot of slot_mapping, got shape ", p.sym_sizes());
  } else {
    TORCH_CHECK(ok, "posenc: rope_shift_kv: expected ", name, " of shape (n,) = (", n,
                ",) or (batch, n) = (", batch, ", ", n, "), one position per row turned, got shape ",
                p.sym_sizes());
  }
}

void check_seq_len(const char* name, const std::optional<c10::SymInt>& v) {
  if (!v.has_value()) return;
  if (const auto x = v->maybe_as_int()) {
    TORCH_CHECK_VALUE(*x >= 0, "posenc: rope_shift_kv: expected ", name,
                      " >= 0 (the longest position + 1) or None, got ", *x);
  }
}

}  // namespace

int64_t check_rope_shift_kv(const RopeShiftKvCall& c) {
  const RopeLayout layout = c.config.layout;
  TORCH_CHECK_VALUE(layout != RopeLayout::kSBHD, "posenc: rope_shift_kv: expected layout 'bshd', "
                    "'bhsd' (contiguous cache) or 'thd' (paged cache), got 'sbhd'");
  const at::Tensor& cache = c.k_cache;
  TORCH_CHECK_TYPE(is_supported_float(cache.scalar_type()) || kv_cache_format(cache) != KvCacheFormat::kSame,
                   "posenc: rope_shift_kv: expected k_cache of dtype float16, bfloat16, float32, "
                   "float64, float8_e4m3fn or float8_e5m2, got ", cache.scalar_type());
  TORCH_CHECK(cache.dim() == 4, "posenc: rope_shift_kv: expected k_cache of shape ",
              cache_shape(layout), " for layout '", rope_layout_name(layout), "', got shape ",
              cache.sym_sizes());
  check_index("from_positions", c.from_positions, cache);
  check_index("to_positions", c.to_positions, cache);
  TORCH_CHECK(c.from_positions.dim() >= 1, "posenc: rope_shift_kv: expected from_positions of "
              "shape (n,) or (batch, n), got shape ", c.from_positions.sym_sizes());
  const at::Tensor cv = kv_cache_view(cache, layout);
  const c10::SymInt batch = c.paged() ? c10::SymInt(1) : cv.sym_size(0);
  const c10::SymInt n = c.from_positions.sym_size(-1);
  const int64_t axes = c.config.n_axes();
  check_positions("from_positions", c.from_positions, batch, n, axes, c.paged());
  check_positions("to_positions", c.to_positions, batch, n, axes, c.paged());
  if (c.paged()) {
    TORCH_CHECK_VALUE(c.slot_mapping.has_value(), "posenc: rope_shift_kv: layout 'thd' (a paged "
                      "cache) needs slot_mapping, the slot of each position (-1: not turned)");
    TORCH_CHECK_VALUE(!c.rows.has_value(), "posenc: rope_shift_kv: rows is for contiguous caches "
                      "(layouts 'bshd', 'bhsd'); a paged cache ('thd') names its rows by slot_mapping");
    check_index("slot_mapping", *c.slot_mapping, cache);
    TORCH_CHECK(c.slot_mapping->dim() == 1 && c.slot_mapping->sym_size(0) == n,
                "posenc: rope_shift_kv: expected slot_mapping of shape (n,) = (", n,
                ",), one slot per position, got shape ", c.slot_mapping->sym_sizes());
  } else {
    TORCH_CHECK_VALUE(!c.slot_mapping.has_value(), "posenc: rope_shift_kv: slot_mapping is for "
                      "paged caches (layout 'thd'); a contiguous cache names its rows by rows, "
                      "got layout '", rope_layout_name(layout), "'");
    if (c.rows.has_value()) {
      const at::Tensor& r = *c.rows;
      check_index("rows", r, cache);
      const bool ok = (r.dim() == 1 || (r.dim() == 2 && (r.sym_size(0) == batch || r.sym_size(0) == 1))) &&
                      r.sym_size(-1) == n;
      TORCH_CHECK(ok, "posenc: rope_shift_kv: expected rows of shape (n,) = (", n,
                  ",) or (batch, n) = (", batch, ", ", n, "), one cache row per position, got shape ",
                  r.sym_sizes());
    }
  }
  if (c.k_scale.has_value()) {
    const at::Tensor& s = *c.k_scale;
    TORCH_CHECK_VALUE(kv_cache_format(cache) != KvCacheFormat::kSame, "posenc: rope_shift_kv: k_scale "
                      "is only used with a float8 k_cache (its values are multiplied by it), got "
                      "k_cache of dtype ", cache.scalar_type());
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "posenc: rope_shift_kv: expected k_scale to be "
                     "a Python float or a float32 tensor, got a tensor of dtype ", s.scalar_type());
    TORCH_CHECK_VALUE(s.dim() <= 1 && s.sym_numel() == 1, "posenc: rope_shift_kv: expected k_scale "
                      "to hold one value (shape () or (1,)), got shape ", s.sym_sizes());
    TORCH_CHECK_VALUE(s.is_cpu() || s.device() == cache.device(), "posenc: rope_shift_kv: expected "
                      "k_scale on the CPU or on k_cache's device ", cache.device(), ", got k_scale on ",
                      s.device());
  }
  check_seq_len("from_seq_len", c.from_seq_len);
  check_seq_len("to_seq_len", c.to_seq_len);
  // RoPE's own checks of the configuration against the items (rotary_dim, scaling, sections).
  const RopeCall to = c.end(true);
  const int64_t rot = check_rope_structure(to);
  check_rope_settings(to);
  return rot;
}

namespace {

// Each (row, item) of one batch row or the slots: in range, each listed once. A strictly
// increasing list (a context shift's rows) is checked in one pass, without a copy; any other is
// sorted with the items' indices to name two that list the same row.
void check_targets(const char* name, const int64_t* v, int64_t n, int64_t limit, bool skip_minus_one,
                   const char* range, int64_t batch_row) {
  // Only built for a message (TORCH_CHECK evaluates its message where the check fails).
  const auto where = [batch_row] {
    return batch_row < 0 ? std::string() : " of batch row " + std::to_string(batch_row);
  };
  bool increasing = true;
  int64_t last = -1;  // below every row and slot
  for (int64_t j = 0; j < n; ++j) {
    if (skip_minus_one && v[j] == -1) continue;
    TORCH_CHECK_INDEX(v[j] >= 0 && v[j] < limit, "posenc: rope_shift_kv: ", name, "[", j, "] = ", v[j],
                      where(), " is out of range for ", range, " = ", limit,
                      skip_minus_one ? " (-1: not turned)" : "", "; nothing was written");
    increasing = increasing && last < v[j];
    last = v[j];
  }
  if (increasing) return;
  std::vector<std::pair<int64_t, int64_t>> seen;
  seen.reserve(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    if (!(skip_minus_one && v[j] == -1)) seen.emplace_back(v[j], j);
  }
  std::sort(seen.begin(), seen.end());
  for (size_t i = 1; i < seen.size(); ++i) {
    TORCH_CHECK_VALUE(seen[i].first != seen[i - 1].first, "posenc: rope_shift_kv: ", name, "[",
                      seen[i - 1].second, "] and ", name, "[", seen[i].second, "] are both ",
                      seen[i].first, where(), "; expected each ", skip_minus_one ? "slot" : "row",
                      " once (it would turn twice); nothing was written");
  }
}

}  // namespace

void check_rope_shift_kv_values(const RopeShiftKvCall& c) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"from_positions", &c.from_positions},
                                {"to_positions", &c.to_positions}}) {
    if (!t->is_cpu()) continue;
    const at::Tensor p = t->contiguous();
    const int64_t* v = p.const_data_ptr<int64_t>();
    for (int64_t i = 0, m = p.numel(); i < m; ++i) check_rope_position_value(name, v[i]);
  }
  if (c.k_scale.has_value() && c.k_scale->is_cpu()) {
    const float v = *c.k_scale->contiguous().const_data_ptr<float>();
    TORCH_CHECK_VALUE(std::isfinite(v) && v > 0.0f, "posenc: rope_shift_kv: expected k_scale to be "
                      "a finite positive number (the values are multiplied and divided by it), got ", v);
    // Dequantised, the format's largest value times the scale must be finite in float32
    // (else it would turn into inf and NaN).
    const float fmax = kv_format_max(kv_cache_format(c.k_cache));
    TORCH_CHECK_VALUE(static_cast<double>(v) * fmax <= std::numeric_limits<float>::max(), "posenc: rope_shift_kv: "
                      "expected k_scale * ", fmax, " (the format's largest value, dequantised) to be finite "
                      "in float32, got k_scale = ", v);
  }
  const at::Tensor cv = kv_cache_view(c.k_cache, c.config.layout);
  const int64_t n = c.n();
  if (c.paged()) {
    if (!c.slot_mapping->is_cpu()) return;
    const at::Tensor s = c.slot_mapping->contiguous();
    check_targets("slot_mapping", s.const_data_ptr<int64_t>(), n, cv.size(0) * cv.size(1), true,
                  "num_blocks * block_size", -1);
    return;
  }
  const int64_t max_len = cv.size(1);
  if (!c.rows.has_value()) {
    TORCH_CHECK_INDEX(n <= max_len, "posenc: rope_shift_kv: without rows, rows 0 .. n - 1 = ", n - 1,
                      " turn, out of range for max_len = ", max_len, "; nothing was written");
    return;
  }
  if (!c.rows->is_cpu()) return;
  const at::Tensor r = c.rows->contiguous();
  const int64_t lines = r.dim() == 2 ? r.size(0) : 1;
  for (int64_t b = 0; b < lines; ++b) {
    check_targets("rows", r.const_data_ptr<int64_t>() + b * n, n, max_len, false, "max_len",
                  r.dim() == 2 ? b : -1);
  }
}

void check_rope_shift_kv_overlap(const RopeShiftKvCall& c) {
  const auto optional = [](const std::optional<at::Tensor>& t) { return t ? &*t : nullptr; };
  check_written_memory("rope_shift_kv_", {{"k_cache", &c.k_cache}},
                       {{"from_positions", &c.from_positions}, {"to_positions", &c.to_positions},
                        {"rows", optional(c.rows)}, {"slot_mapping", optional(c.slot_mapping)},
                        {"k_scale", optional(c.k_scale)}},
                       "the cache must be memory of its own (pass copies of the index tensors)");
}

// ---- The launch preparation

ShiftKvLaunch prepare_shift_kv_launch(const RopeShiftKvCall& c, int64_t rot) {
  ShiftKvLaunch launch;
  for (const bool to : {false, true}) {
    const RopeCall e = c.end(to);
    (to ? launch.to : launch.from) = prepare_rope_launch(e, rot, e.q, std::nullopt);
  }
  RopeShiftKvArgs& a = launch.args;
  a.from = launch.from.args;
  a.to = launch.to.args;
  a.factor = a.to.attention_factor / a.from.attention_factor;
  a.from.attention_factor = 1.0;
  a.to.attention_factor = 1.0;
  const at::Tensor cv = kv_cache_view(c.k_cache, c.config.layout);
  a.heads = cv.size(2);
  a.cache = cv.mutable_data_ptr();
  for (int d = 0; d < 4; ++d) a.cache_stride[d] = cv.stride(d);
  if (c.paged()) {
    launch.slot_mapping = c.slot_mapping->contiguous();
    a.slot_mapping = launch.slot_mapping.const_data_ptr<int64_t>();
    a.block_size = cv.size(1);
    a.num_slots = cv.size(0) * cv.size(1);
  } else {
    a.max_len = cv.size(1);
    if (c.rows.has_value()) {
      launch.rows = c.rows->contiguous();
      a.rows = launch.rows.const_data_ptr<int64_t>();
      a.rows_batch_stride = c.rows->dim() == 2 && c.rows->size(0) != 1 ? c.n() : 0;
    }
  }
  a.format = kv_cache_format(c.k_cache);
  if (c.k_scale.has_value() && !c.k_scale->is_cpu()) {
    a.scale_ptr = c.k_scale->const_data_ptr<float>();  // read (and checked) by the kernel
  } else if (c.k_scale.has_value()) {
    a.scale = *c.k_scale->contiguous().const_data_ptr<float>();  // checked by the values' check
  }
  return launch;
}

// ---- The schema and the Autograd kernel

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  const std::string schema =
      "rope_shift_kv_(Tensor(a!) k_cache, Tensor from_positions, Tensor to_positions, "
      "Tensor? rows=None, Tensor? slot_mapping=None, Tensor? k_scale=None, "
      "SymInt? from_seq_len=None, SymInt? to_seq_len=None, " + config_schema() + ") -> ()";
  m.def(schema.c_str());
}

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("rope_shift_kv_", torch::CppFunction::makeFromBoxedFunction<&inference_only_autograd>());
}

POSENC_REGISTER_WRITTEN_LAYERS("rope_shift_kv_")

// ---- The Meta kernel: the real kernels' checks, the memory proof included (the cache is a mutated argument of the
// schema: functionalization handles it).

namespace {

void rope_shift_kv_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeShiftKvCall c = RopeShiftKvCall::pop(*stack);
  check_not_mixed_with_meta("rope_shift_kv_", {{"k_cache", &c.k_cache},
                                               {"from_positions", &c.from_positions},
                                               {"to_positions", &c.to_positions},
                                               {"rows", optional_ptr(c.rows)},
                                               {"slot_mapping", optional_ptr(c.slot_mapping)},
                                               {"k_scale", optional_ptr(c.k_scale)}});
  check_rope_shift_kv(c);
  check_rope_shift_kv_overlap(c);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("rope_shift_kv_", torch::CppFunction::makeFromBoxedFunction<&rope_shift_kv_meta>());
}

// ---- The ATen composite
// rope_shift_kv_ composed from ATen ops, for backends without a kernel of their own (the ATen
// fallback): the same checks; the rows gathered, turned by the angle new - old (cos and sin
// of both float64 angles, combined in float64, rounded once to the working precision), and
// scattered back. One error contract with the kernels, and no host sync but the one rope's
// seq_len=-1 pays (a length-scaled type without from_seq_len / to_seq_len on a device):
// - CPU index tensors are checked on the host before anything is written (the kernel's
//   check_rope_shift_kv_values);
// - on a device a row outside the cache fails on the device (at::_assert_async where the
//   device has it, and an index outside the cache that makes index_put_ fail), and slots -1
//   write nothing without being left out of the index (write_paged_rows, aten_fallback.h).

namespace {

// The seq_len an end's frequencies use: given, or the longest position + 1 (a length-scaled
// type only; a sync on a device, as rope's seq_len=-1).
int64_t end_seq_len(const RopeCall& e) {
  if (const int64_t given = e.concrete_seq_len(); given >= 0) return given;
  const at::Tensor& p = *e.positions;
  return p.numel() == 0 ? 0 : std::max<int64_t>(p.max().item<int64_t>() + 1, 0);
}

void rope_shift_kv_composite(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeShiftKvCall c = RopeShiftKvCall::pop(*stack);
  const int64_t rot = check_rope_shift_kv(c);
  check_rope_shift_kv_overlap(c);
  check_rope_shift_kv_values(c);  // CPU index tensors only
  const at::Tensor& cache = c.k_cache;
  const at::Device device = cache.device();
  warn_aten_fallback("rope_shift_kv_", device);
  const int64_t n = c.n(), half = rot / 2;
  const at::Tensor cv = kv_cache_view(cache, c.config.layout);
  const int64_t batch = c.batch();
  if (n == 0 || batch == 0 || half == 0 || cv.numel() == 0) return;
  const KvCacheFormat format = kv_cache_format(cache);
  const at::ScalarType wide = fallback_wide_dtype(device);
  const at::ScalarType acc = cache.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const RopeCall from = c.end(false), to = c.end(true);
  const RopeCall& cfg = c.config;
  const RopePairFrequencies ff = rope_pair_frequencies(rot, cfg.base, cfg.scaling, end_seq_len(from),
                                                       cfg.sections, cfg.sections_mode);
  const RopePairFrequencies ft = rope_pair_frequencies(rot, cfg.base, cfg.scaling, end_seq_len(to),
                                                       cfg.sections, cfg.sections_mode);
  const double factor = ft.attention_factor / ff.attention_factor;
  const std::vector<int64_t> axis(ff.axis.begin(), ff.axis.end());
  const at::Tensor axis_t = at::tensor(axis, at::kLong).to(device);
  const int64_t axes = cfg.n_axes();
  // An end's position per pair (batch, n, half): positions (axes, batch, n) gathered by each
  // pair's axis; and its angles.
  const auto pair_positions = [&](const at::Tensor& p) {
    at::Tensor q = axes > 1 ? p : p.unsqueeze(0);
    if (q.dim() == 2) q = q.unsqueeze(1);
    return q.expand({axes, batch, n}).index_select(0, axis_t).permute({1, 2, 0});
  };
  const at::Tensor po = pair_positions(c.from_positions), pn = pair_positions(c.to_positions);
  const at::Tensor ao = po.to(wide) * at::tensor(ff.inv_freq, at::kDouble).to(device, wide);
  const at::Tensor an = pn.to(wide) * at::tensor(ft.inv_freq, at::kDouble).to(device, wide);
  const at::Tensor co = ao.cos(), so = ao.sin(), cn = an.cos(), sn = an.sin();
  const at::Tensor cs = ((cn * co + sn * so) * factor).to(acc).unsqueeze(2);  // (batch, n, 1, half)
  const at::Tensor ss = ((sn * co - cn * so) * factor).to(acc).unsqueeze(2);
  // Rows all of whose pairs keep their angle (rope_shift_keeps: the same position, cos and
  // sin at both ends, factor 1) are written back as they were: (batch, n, 1, 1).
  const at::Tensor keeps = po.eq(pn).logical_and(cn.eq(co)).logical_and(sn.eq(so))
                               .logical_and(at::scalar_tensor(factor == 1.0, ao.options().dtype(at::kBool)))
                               .all(-1, /*keepdim=*/true).unsqueeze(2);

  // The rows: gathered as their bits (FP8: uint8 views, which the indexing ops take).
  const bool fp8 = format != KvCacheFormat::kSame;
  const at::Tensor store = fp8 ? cv.view(at::kByte) : cv;
  at::Tensor i0, i1, slots, unwritten;
  if (c.paged()) {
    slots = c.slot_mapping->contiguous();
    const int64_t blocks = cv.size(0), block_size = cv.size(1), num_slots = blocks * block_size;
    unwritten = slots.eq(-1);
    const at::Tensor valid = slots.ge(-1).logical_and(slots.lt(num_slots));
    if (!slots.is_cpu()) {
      assert_all_on_device(unwritten.logical_or(slots.ge(0).logical_and(slots.lt(num_slots))),
                           "posenc: rope_shift_kv: a slot_mapping value is out of range for the "
                           "cache (num_blocks * block_size slots; -1: not turned)");
    }
    const at::Tensor target = slots.masked_fill(unwritten, 0);
    i0 = target.div(block_size, "floor").masked_fill_(valid.logical_not(), blocks);
    i1 = target.remainder(block_size);
  } else {
    const int64_t max_len = cv.size(1);
    at::Tensor rows = c.rows.has_value() ? *c.rows : steps_like(c.from_positions, n);
    rows = rows.reshape({-1, n}).expand({batch, n});
    if (!rows.is_cpu()) {
      const at::Tensor ok = rows.ge(0).logical_and(rows.lt(max_len));
      assert_all_on_device(ok, "posenc: rope_shift_kv: a rows value is out of range for max_len");
      rows = rows.masked_fill(ok.logical_not(), max_len);
    }
    i0 = steps_like(rows, batch).unsqueeze(1).expand({batch, n});
    i1 = rows;
  }
  at::Tensor bits = store.index({i0, i1});  // (batch, n, heads, d); paged (n, heads, d)
  if (c.paged()) bits = bits.unsqueeze(0);
  at::Tensor scale;
  if (fp8 && c.k_scale.has_value()) {
    scale = c.k_scale->reshape({}).to(device);
    if (!c.k_scale->is_cpu()) {
      assert_all_on_device(scale.gt(0).logical_and(
                               scale.to(at::kDouble).mul(kv_format_max(format)).le(std::numeric_limits<float>::max())),
                           "posenc: rope_shift_kv: expected k_scale to be a finite positive number, "
                           "at most float32's largest value / the format's largest");
    }
  }
  const int64_t begin = math::rope_rotary_begin(cfg.settings);
  at::Tensor x = bits.narrow(-1, begin, rot);
  x = fp8 ? x.view(cache.scalar_type()).to(at::kFloat) : x.to(acc);
  if (scale.defined()) x = x * scale;
  const at::Tensor x1 = cfg.interleaved ? x.slice(-1, 0, rot, 2) : x.narrow(-1, 0, half);
  const at::Tensor x2 = cfg.interleaved ? x.slice(-1, 1, rot, 2) : x.narrow(-1, half, half);
  const at::Tensor y1 = x1 * cs - x2 * ss, y2 = x2 * cs + x1 * ss;
  at::Tensor y = cfg.interleaved ? at::stack({y1, y2}, -1).flatten(-2) : at::cat({y1, y2}, -1);
  if (fp8) {
    if (scale.defined()) y = y.div(scale);
    const double m = kv_format_max(format);
    y = y.clamp(-m, m).to(cache.scalar_type()).view(at::kByte);
  } else {
    y = y.to(cache.scalar_type());
  }
  at::Tensor out = bits.clone();
  out.narrow(-1, begin, rot).copy_(y);
  out = at::where(keeps, bits, out);
  if (c.paged()) {
    write_paged_rows(store, out.squeeze(0), slots, unwritten, i0, i1);
  } else {
    store.index_put_({i0, i1}, out);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("rope_shift_kv_", torch::CppFunction::makeFromBoxedFunction<&rope_shift_kv_composite>());
}

// ---- CPU backend: every value checked before the kernel writes anything (IndexError /
// ValueError, the cache unchanged), then the kernel of cpu/kernel.cpp.

namespace {

void rope_shift_kv_cpu(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeShiftKvCall c = RopeShiftKvCall::pop(*stack);
  const int64_t rot = check_rope_shift_kv(c);
  check_rope_shift_kv_overlap(c);
  check_rope_shift_kv_values(c);
  const ShiftKvLaunch launch = prepare_shift_kv_launch(c, rot);
  const at::ScalarType dtype = kv_cache_format(c.k_cache) == KvCacheFormat::kSame ? c.k_cache.scalar_type()
                                                                                : at::kFloat;
  cpu::rope_shift_kv_stub::get()(launch.args, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope_shift_kv_", torch::CppFunction::makeFromBoxedFunction<&rope_shift_kv_cpu>());
}

}  // namespace ops
}  // namespace posenc

// ---- CUDA backend: the same structural checks (values are checked on the device), then
// the launch of cuda/rope_shift_kv/rope_shift_kv.cu's kernel on the cache's device and
// current stream.
#if defined(POSENC_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/rope_shift_kv/launch.h"

namespace posenc {
namespace ops {
namespace {

void rope_shift_kv_cuda(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeShiftKvCall c = RopeShiftKvCall::pop(*stack);
  const int64_t rot = check_rope_shift_kv(c);
  check_rope_shift_kv_overlap(c);
  // The host-side values (a k_scale given as a float is a CPU tensor): a ValueError before
  // anything is written, as on the CPU; device tensors are left to the kernel's assert.
  check_rope_shift_kv_values(c);
  const c10::cuda::CUDAGuard guard(c.k_cache.device());
  const ShiftKvLaunch launch = prepare_shift_kv_launch(c, rot);
  const RopeShiftKvArgs& a = launch.args;
  const at::ScalarType dtype = a.format == KvCacheFormat::kSame ? c.k_cache.scalar_type() : at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "posenc_rope_shift_kv_cuda", [&] {
    C10_CUDA_CHECK(launch_rope_shift_kv<scalar_t>(a, at::cuda::getCurrentCUDAStream()));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("rope_shift_kv_", torch::CppFunction::makeFromBoxedFunction<&rope_shift_kv_cuda>());
}

}  // namespace ops
}  // namespace posenc
#endif  // POSENC_WITH_CUDA
