// RopeCall: the schemas of the RoPE ops, and the one reader and writer of their arguments.
#include "ops/common/rope_call.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "ops/common/autograd_node.h"  // call_pair
#include "ops/common/op_handles.h"
#include "ops/common/rope_args.h"

namespace posenc {
namespace ops {

// rope_type and scaling carry Hugging Face's rope_scaling dict: [] for "default" with no
// key, else [given, the keys of POSENC_ROPE_SCALING_KEYS in posenc/math/rope.h (0 where not
// given), then longrope's lists], `given` the bitmask of the keys the dict gave (bit i: key
// i; an integer, exact as a double). Presence is the mask's, never a value's. seq_len (longest position + 1) matters for "dynamic" and "longrope";
// -1 derives it from the call (a device sync when index tensors are CUDA tensors).
// rotary_dim=-1: head_dim. sections (pairs per axis) make positions (n_axes, ...)
// coordinates, see RopeSectionsMode.
const char* const kRopeSchemaArguments =
    "Tensor? positions=None, Tensor? offsets=None, SymInt offset=0, Tensor? cu_seqlens=None, "
    "float base=10000.0, str rope_type=\"default\", float[] scaling=[], SymInt seq_len=0, "
    "int rotary_dim=-1, bool interleaved=False, str layout=\"bshd\", bool inverse=False, "
    "int[] sections=[], str sections_mode=\"axial\""
#define POSENC_X(type, name, default_value, schema_type) \
  ", " schema_type " " #name "=" #default_value
    POSENC_ROPE_SETTINGS(POSENC_X)
#undef POSENC_X
    ;

std::optional<at::Tensor> optional_tensor(const c10::IValue& v) {
  if (v.isNone() || !v.toTensor().defined()) return std::nullopt;
  return v.toTensor();
}
std::optional<at::Tensor> optional_tensor(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t : std::nullopt;
}
c10::IValue optional_tensor_ivalue(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? c10::IValue(*t) : c10::IValue();
}

namespace {

constexpr std::pair<RopeLayout, const char*> kLayouts[] = {
    {RopeLayout::kBSHD, "bshd"}, {RopeLayout::kBHSD, "bhsd"}, {RopeLayout::kSBHD, "sbhd"},
    {RopeLayout::kTHD, "thd"}};
// (batch, seq, heads) dims per layout, indexed by RopeLayout (kLayouts' order).
constexpr RopeLayoutAxes kLayoutAxes[] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {-1, 0, 1}};
constexpr std::pair<math::RopeType, const char*> kRopeTypes[] = {
#define POSENC_X(e, name, facts, keys) {math::RopeType::e, name},
    POSENC_ROPE_TYPES(POSENC_X)
#undef POSENC_X
};
constexpr std::pair<math::RopeSectionsMode, const char*> kSectionsModes[] = {
#define POSENC_X(e, name) {math::RopeSectionsMode::e, name},
    POSENC_ROPE_SECTIONS_MODES(POSENC_X)
#undef POSENC_X
};
constexpr const char* kScalingKeys[] = {
#define POSENC_X(key) #key,
    POSENC_ROPE_SCALING_KEYS(POSENC_X)
#undef POSENC_X
};
constexpr double math::RopeScalingParams::*kScalingFields[] = {
#define POSENC_X(key) &math::RopeScalingParams::key,
    POSENC_ROPE_SCALING_KEYS(POSENC_X)
#undef POSENC_X
};
constexpr const char* kScalingListKeys[] = {
#define POSENC_X(key) #key,
    POSENC_ROPE_SCALING_LIST_KEYS(POSENC_X)
#undef POSENC_X
};
using ScalingList = double (math::RopeScalingParams::*)[math::kRopeMaxPairs];
constexpr ScalingList kScalingListFields[] = {
#define POSENC_X(key) &math::RopeScalingParams::key,
    POSENC_ROPE_SCALING_LIST_KEYS(POSENC_X)
#undef POSENC_X
};
constexpr int kScalingLists = sizeof(kScalingListKeys) / sizeof(kScalingListKeys[0]);

template <typename E, size_t N>
std::string quoted_names(const std::pair<E, const char*> (&table)[N]) {
  std::ostringstream out;
  for (size_t i = 0; i < N; ++i) out << (i == 0 ? "" : i + 1 == N ? " or " : ", ") << "'" << table[i].second << "'";
  return out.str();
}

template <typename E, size_t N>
E parse_name(const std::pair<E, const char*> (&table)[N], const char* what,
             const std::string& name) {
  for (const auto& [value, n] : table) {
    if (name == n) return value;
  }
  TORCH_CHECK_VALUE(false, "posenc: unknown ", what, " '", name, "'; expected one of ",
                    quoted_names(table));
}

template <typename E, size_t N>
const char* name_of(const std::pair<E, const char*> (&table)[N], E value) {
  for (const auto& [v, n] : table) {
    if (v == value) return n;
  }
  return "?";
}

template <size_t N>
std::string joined(const char* const (&names)[N]) {
  std::ostringstream out;
  for (size_t i = 0; i < N; ++i) out << (i ? ", " : "") << names[i];
  return out.str();
}

// The values of a scaling dict into `out`, whose type is already set: the keys, then (for
// the types with list keys) each list, all of one length (checked against rotary_dim later).
void read_scaling_values(const std::vector<double>& fields, math::RopeScalingParams& out) {
  if (out.type == math::RopeType::kDefault && fields.empty()) return;
  const int64_t extra = static_cast<int64_t>(fields.size()) - 1 - math::kRopeScalingFields;
  const bool lists = (math::rope_type_facts(out.type) & math::kRopeListKeys) != 0;
  TORCH_CHECK_VALUE(lists || extra <= 0, "posenc: rope scaling type '", rope_type_name(out.type),
                    "' reads no list key (", joined(kScalingListKeys), "), got ", extra, " list values after its 1 + ",
                    math::kRopeScalingFields, " rope scaling values");
  TORCH_CHECK_VALUE(lists ? extra > 0 && extra % kScalingLists == 0 &&
                                extra / kScalingLists <= math::kRopeMaxPairs
                          : extra == 0,
                    "posenc: expected 1 + ", math::kRopeScalingFields, " rope scaling values (the "
                    "bitmask of the keys given, then ", joined(kScalingKeys), ", 0 for a key not given)",
                    lists ? ", then the lists short_factor and long_factor of equal lengths (at "
                            "most 256 each)" : "",
                    " for rope_type '", rope_type_name(out.type), "', got ", fields.size());
  const double mask = fields[0];
  constexpr double kAllKeys = static_cast<double>((uint64_t{1} << math::kRopeScalingFields) - 1);
  TORCH_CHECK_VALUE(mask >= 0.0 && mask <= kAllKeys && mask == std::floor(mask),
                    "posenc: expected the first rope scaling value to be the bitmask of the keys "
                    "given (an integer in [0, ", kAllKeys, "]), got ", mask);
  out.given = static_cast<uint32_t>(mask);
  for (int i = 0; i < math::kRopeScalingFields; ++i) {
    const double v = fields[1 + i];
    if (!math::rope_has(out, static_cast<math::RopeKey>(i))) {
      TORCH_CHECK_VALUE(v == 0.0, "posenc: expected rope scaling key '", kScalingKeys[i],
                        "', which the bitmask says was not given, to be 0, got ", v);
      continue;
    }
    TORCH_CHECK_VALUE(std::isfinite(v), "posenc: expected rope scaling key '", kScalingKeys[i],
                      "' to be finite, got ", v);
    out.*kScalingFields[i] = v;
  }
  // A key the type does not read (math::rope_type_keys) would be ignored: a scaling that
  // silently does not happen (for "default", C++'s RopeScaling left at its default rope_type
  // with a factor set). Python's dict reader drops such keys with a warning first, as
  // transformers ignores them; partial_rotary_factor it leaves to this refusal, whose advice
  // says what the key means for those types (rotary_dim, which the front ends resolve from a
  // config: Python's resolve_config_keys).
  const uint32_t unread = out.given & ~math::rope_type_keys(out.type);
  if (unread != 0) {
    TORCH_CHECK_VALUE((unread & math::rope_key_bit(math::RopeKey::partial_rotary_factor)) == 0,
                      "posenc: rope scaling type '", rope_type_name(out.type), "' does not read the key "
                      "'partial_rotary_factor' (it sets rotary_dim there, as in a transformers config): pass "
                      "rotary_dim = int(head_dim * ", out.partial_rotary_factor, ") instead");
    const auto names = [](uint32_t mask) {
      std::string joined_names;
      for (int i = 0; i < math::kRopeScalingFields; ++i) {
        if (mask & math::rope_key_bit(static_cast<math::RopeKey>(i))) {
          joined_names += std::string(joined_names.empty() ? "" : ", ") + kScalingKeys[i];
        }
      }
      return joined_names;
    };
    if (out.type == math::RopeType::kDefault) {
      std::string types;
      for (const auto& [type, name] : kRopeTypes) {
        if (type != math::RopeType::kDefault) types += std::string(types.empty() ? "" : ", ") + name;
      }
      TORCH_CHECK_VALUE(false, "posenc: rope scaling type 'default' reads no rope scaling key, got ", names(unread),
                        ": set rope_type to the scaling that reads them (", types, ")");
    }
    TORCH_CHECK_VALUE(false, "posenc: rope scaling type '", rope_type_name(out.type), "' does not read the rope "
                      "scaling key(s) ", names(unread), " (it reads ", names(math::rope_type_keys(out.type)),
                      "): leave them out, as transformers ignores them");
  }
  if (!lists) return;
  out.list_length = extra / kScalingLists;
  for (int l = 0; l < kScalingLists; ++l) {
    for (int64_t i = 0; i < out.list_length; ++i) {
      const double v = fields[1 + math::kRopeScalingFields + l * out.list_length + i];
      TORCH_CHECK_VALUE(std::isfinite(v), "posenc: expected rope scaling key '",
                        kScalingListKeys[l], "' to hold finite numbers, got ", v, " at index ", i);
      (out.*kScalingListFields[l])[i] = v;
    }
  }
}

// ---- Reading one argument (IValue -> field), by the field's type.
// q as given; an undefined tensor (a C++ caller's torch::Tensor()) is refused with its name,
// before any op reads it. The optional tensors (k, positions, offsets, cu_seqlens) read an
// undefined tensor as None, as ATen's ops read an optional tensor and as the KV-cache ops'
// own optional arguments do (optional_tensor); the ops that need k (qk_norm_rope,
// rope_append_kv) refuse its absence where they pop their call, before their kernels read it.
void read(const c10::IValue& v, const char* name, at::Tensor& out) {
  out = v.toTensor();
  TORCH_CHECK_VALUE(out.defined(), "posenc: expected ", name, " to be a tensor, got an undefined tensor");
}
void read(const c10::IValue& v, const char*, std::optional<at::Tensor>& out) { out = optional_tensor(v); }
void read(const c10::IValue& v, const char*, c10::SymInt& out) { out = v.toSymInt(); }
void read(const c10::IValue& v, const char*, double& out) { out = v.toDouble(); }
void read(const c10::IValue& v, const char*, int64_t& out) { out = v.toInt(); }
void read(const c10::IValue& v, const char*, bool& out) { out = v.toBool(); }
// An empty list may arrive as None: torch 2.11's AOTInductor proxy executor leaves an empty
// serialized int or float list as None on the stack (fixed upstream, pytorch#194324), and
// every RoPE call without sections or scaling has one.
void read(const c10::IValue& v, const char*, std::vector<int64_t>& out) {
  out = v.isNone() ? std::vector<int64_t>{} : v.toIntVector();
}
void read(const c10::IValue& v, const char*, RopeLayout& out) {
  out = parse_rope_layout(v.toStringRef());
}
void read(const c10::IValue& v, const char*, math::RopeType& out) {
  out = parse_name(kRopeTypes, "rope scaling type", v.toStringRef());
}
void read(const c10::IValue& v, const char*, math::RopeSectionsMode& out) {
  out = parse_rope_sections_mode(v.toStringRef());
}
// The values of the scaling dict (its type was read just before, from rope_type).
void read(const c10::IValue& v, const char*, math::RopeScalingParams& out) {
  read_scaling_values(v.isNone() ? std::vector<double>{} : v.toDoubleVector(), out);
}

// ---- Writing one argument (field -> IValue).
c10::IValue write(const at::Tensor& t) { return t; }
c10::IValue write(const std::optional<at::Tensor>& t) { return t; }
c10::IValue write(const c10::SymInt& v) { return v; }
c10::IValue write(double v) { return v; }
c10::IValue write(int64_t v) { return v; }
c10::IValue write(bool v) { return v; }
c10::IValue write(const std::vector<int64_t>& v) { return v; }
c10::IValue write(RopeLayout v) { return std::string(rope_layout_name(v)); }
c10::IValue write(math::RopeType v) { return std::string(rope_type_name(v)); }
c10::IValue write(math::RopeSectionsMode v) { return std::string(name_of(kSectionsModes, v)); }
// The canonical list: [] for a "default" call with no key given; otherwise the bitmask of
// the keys given, every key (0 where not given), then the lists.
c10::IValue write(const math::RopeScalingParams& s) {
  std::vector<double> fields;
  if (s.type == math::RopeType::kDefault && s.given == 0 && s.list_length == 0) return fields;
  fields.push_back(static_cast<double>(s.given));
  for (int i = 0; i < math::kRopeScalingFields; ++i) {
    fields.push_back(math::rope_has(s, static_cast<math::RopeKey>(i)) ? s.*kScalingFields[i] : 0.0);
  }
  for (const auto list : kScalingListFields) {
    fields.insert(fields.end(), s.*list, s.*list + s.list_length);
  }
  return fields;
}


}  // namespace

int RopeCall::argument_count() {
  static const int n = [] {
    int count = 0;
    RopeCall c;
    RopeCall::for_each_argument(c, [&](const char*, auto&) { ++count; });
    return count;
  }();
  return n;
}

math::RopeScalingParams parse_rope_scaling(const std::string& rope_type,
                                           const std::vector<double>& fields) {
  math::RopeScalingParams out;
  out.type = parse_name(kRopeTypes, "rope scaling type", rope_type);
  read_scaling_values(fields, out);
  return out;
}

math::RopeType parse_rope_type(const std::string& name) {
  return parse_name(kRopeTypes, "rope scaling type", name);
}

RopeLayout parse_rope_layout(const std::string& name) {
  return parse_name(kLayouts, "layout", name);
}

math::RopeSectionsMode parse_rope_sections_mode(const std::string& name) {
  return parse_name(kSectionsModes, "sections_mode", name);
}

RopeCall RopeCall::pop(torch::jit::Stack& stack) {
  const int n = RopeCall::argument_count();
  TORCH_INTERNAL_ASSERT(stack.size() >= static_cast<size_t>(n), "posenc: rope call with ",
                        stack.size(), " arguments on the stack, expected ", n);
  RopeCall c;
  size_t i = stack.size() - n;
  for_each_argument(c, [&](const char* name, auto& field) { read(stack[i++], name, field); });
  torch::jit::drop(stack, n);
  return c;
}

void RopeCall::require_k(const char* op) const {
  TORCH_CHECK_VALUE(k.has_value(), "posenc: ", op, ": expected k to be a tensor, got None or an undefined tensor");
}

void RopeCall::push(torch::jit::Stack& stack) const {
  for_each_argument(*this, [&](const char*, const auto& field) { stack.push_back(write(field)); });
}

const char* rope_layout_name(RopeLayout layout) { return name_of(kLayouts, layout); }
const char* rope_type_name(math::RopeType type) { return name_of(kRopeTypes, type); }

std::vector<std::string> rope_type_names() {
  std::vector<std::string> out;
  for (const auto& [v, n] : kRopeTypes) out.emplace_back(n);
  return out;
}

std::vector<std::string> rope_scaling_keys() {
  return std::vector<std::string>(std::begin(kScalingKeys), std::end(kScalingKeys));
}

std::vector<std::string> rope_scaling_list_keys() {
  return std::vector<std::string>(std::begin(kScalingListKeys), std::end(kScalingListKeys));
}

RopeLayoutAxes rope_layout_axes(RopeLayout layout) {
  return kLayoutAxes[static_cast<int>(layout)];
}

// "bshd" is the canonical order itself: x is returned, not an identity permute of it (a view
// through the dispatcher, ~0.5 us, and a call makes several: a decoding step's time).
static bool is_canonical(const RopeLayoutAxes& a) { return a.batch == 0 && a.seq == 1 && a.heads == 2; }

at::Tensor rope_canonical_view(const at::Tensor& x, RopeLayout layout) {
  const RopeLayoutAxes a = rope_layout_axes(layout);
  if (a.batch < 0) return x.unsqueeze(0);  // (tokens, heads, d) -> (1, tokens, heads, d)
  if (is_canonical(a)) return x;
  return x.permute({a.batch, a.seq, a.heads, 3});
}

at::Tensor rope_from_canonical(const at::Tensor& x, RopeLayout layout) {
  const RopeLayoutAxes a = rope_layout_axes(layout);
  if (a.batch < 0) return x.squeeze(0);
  if (is_canonical(a)) return x;
  int64_t inverse[4] = {0, 0, 0, 3};
  inverse[a.batch] = 0;
  inverse[a.seq] = 1;
  inverse[a.heads] = 2;
  return x.permute(inverse);
}

std::tuple<at::Tensor, at::Tensor> call_rope(const RopeCall& call) {
  static const c10::OperatorHandle op = find_boxed_op("posenc::rope");
  torch::jit::Stack stack;
  call.push(stack);
  op.callBoxed(stack);
  return {stack[0].toTensor(), stack[1].toTensor()};
}

void call_rope_inplace(const RopeCall& call) {
  static const c10::OperatorHandle op = find_boxed_op("posenc::rope_");
  torch::jit::Stack stack;
  call.push(stack);
  op.callBoxed(stack);
}

std::tuple<int64_t, int64_t> call_rope_position_bounds(const RopeCall& call) {
  static const c10::OperatorHandle op = find_boxed_op("posenc::rope_position_bounds");
  torch::jit::Stack stack;
  call.push(stack);
  op.callBoxed(stack);
  return {stack[0].toInt(), stack[1].toInt()};
}

std::pair<at::Tensor, at::Tensor> call_rope_pair(RopeCall call, const at::Tensor& a, const at::Tensor& b) {
  return autograd::call_pair(a, b, [&](const at::Tensor& x, const std::optional<at::Tensor>& y) {
    call.q = x;
    call.k = y;
    return call_rope(call);
  });
}

int64_t call_rope_rotary_width(const RopeCall& call) {
  static const c10::OperatorHandle op = find_boxed_op("posenc::rope_rotary_width");
  torch::jit::Stack stack;
  call.push(stack);
  op.callBoxed(stack);
  return stack[0].toInt();
}

void check_rope_schema_matches(const c10::FunctionSchema& schema) {
  const auto& args = schema.arguments();
  size_t i = 0;
  RopeCall c;
  RopeCall::for_each_argument(c, [&](const char* name, auto&) {
    TORCH_INTERNAL_ASSERT(i < args.size() && args[i].name() == name, "posenc: ", schema.name(),
                          " argument ", i, " is '", i < args.size() ? args[i].name() : "",
                          "', RopeCall expects '", name, "'");
    ++i;
  });
  TORCH_INTERNAL_ASSERT(i == args.size(), "posenc: ", schema.name(), " has ", args.size(),
                        " arguments, RopeCall ", i);
}

// Every name list of the RoPE ops and the facts of each scaling type, for Python (its key
// and type lists and its per-type behaviour come from here).
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>,
           std::vector<std::string>, std::vector<std::string>, std::vector<std::string>,
           std::vector<int64_t>, std::vector<int64_t>, int64_t, std::vector<int64_t>>
rope_scaling_spec() {
  std::vector<std::string> layouts, modes, fact_names;
  std::vector<int64_t> axes;
  for (const auto& [v, n] : kLayouts) {
    layouts.emplace_back(n);
    const RopeLayoutAxes a = rope_layout_axes(v);
    axes.insert(axes.end(), {a.batch, a.seq, a.heads});
  }
  for (const auto& [v, n] : kSectionsModes) modes.emplace_back(n);
#define POSENC_X(flag, name) fact_names.emplace_back(name);
  POSENC_ROPE_TYPE_FACTS(POSENC_X)
#undef POSENC_X
  std::vector<int64_t> facts, keys;
  for (const auto& [v, n] : kRopeTypes) {
    facts.push_back(math::rope_type_facts(v));
    keys.push_back(math::rope_type_keys(v));
  }
  return {rope_type_names(), rope_scaling_keys(), layouts, modes, rope_scaling_list_keys(),
          fact_names, facts, axes, kRopeMaxPosition, keys};
}


}  // namespace ops
}  // namespace posenc
