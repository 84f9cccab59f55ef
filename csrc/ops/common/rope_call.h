// One RoPE call, parsed once: the arguments of the ops rope, rope_ and rope_position_bounds
// (they share one schema tail, kRopeSchemaArguments), as the checks, the launch
// preparation, the Meta kernels, autograd and both backends read them.
//
// The argument list exists once: RopeCall::for_each_argument names every field in schema
// order, and from_stack / to_stack (the boxed kernels' input and the boxed op call) are
// both written over it. Registration asserts that the names match the schema, so the two
// cannot drift apart.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/stack.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "posenc/math/rope.h"

namespace posenc {

struct ApplyRopeOptions;  // posenc/rope.h
struct RopeScaling;
struct RopePositions;

namespace ops {

enum class RopeLayout { kBSHD, kBHSD, kSBHD, kTHD };

// The schema of everything after `q, k` in rope / rope_ / rope_position_bounds.
extern const char* const kRopeSchemaArguments;

struct RopeCall {
  at::Tensor q;
  std::optional<at::Tensor> k;
  // Index tensors: positions (seq,) / (batch, seq), or (n_axes, ...) with sections;
  // per-row (per packed sequence) offsets; cumulative lengths for 'thd'.
  std::optional<at::Tensor> positions;
  std::optional<at::Tensor> offsets;
  c10::SymInt offset = 0;
  std::optional<at::Tensor> cu_seqlens;
  double base = 10000.0;
  math::RopeScalingParams scaling;  // rope_type and the float[] scaling, together
  // "dynamic", "longrope": longest position + 1; -1: from the call. A SymInt, so that
  // torch.compile keeps a decoding loop's seq_len dynamic (its checks read it only where it is
  // concrete; the kernels, which run on concrete values, take concrete_seq_len()).
  c10::SymInt seq_len = 0;
  int64_t rotary_dim = -1;  // -1: head_dim
  bool interleaved = false;
  RopeLayout layout = RopeLayout::kBSHD;
  bool inverse = false;  // rotate by -angle (the backward)
  std::vector<int64_t> sections;  // pairs per axis; empty: one axis
  math::RopeSectionsMode sections_mode = math::RopeSectionsMode::kAxial;
  math::RopeSettings settings;  // the plain settings (POSENC_ROPE_SETTINGS), last in the schema

  // f(name, field) for every schema argument, in schema order. `scaling` is visited twice:
  // as "rope_type" (its type) and as "scaling" (its values).
  template <typename Call, typename F>
  static void for_each_argument(Call& c, F&& f) {
    f("q", c.q);
    f("k", c.k);
    f("positions", c.positions);
    f("offsets", c.offsets);
    f("offset", c.offset);
    f("cu_seqlens", c.cu_seqlens);
    f("base", c.base);
    f("rope_type", c.scaling.type);
    f("scaling", c.scaling);
    f("seq_len", c.seq_len);
    f("rotary_dim", c.rotary_dim);
    f("interleaved", c.interleaved);
    f("layout", c.layout);
    f("inverse", c.inverse);
    f("sections", c.sections);
    f("sections_mode", c.sections_mode);
#define POSENC_X(type, name, default_value, schema_type) f(#name, c.settings.name);
    POSENC_ROPE_SETTINGS(POSENC_X)
#undef POSENC_X
  }

  // Pops the arguments of a boxed call (the whole schema) off the stack. Strings and the
  // scaling list are parsed here: an unknown name or a malformed list is a ValueError
  // naming the argument.
  static RopeCall pop(torch::jit::Stack& stack);
  // Pushes the arguments, in schema order, for a boxed call of rope / rope_.
  void push(torch::jit::Stack& stack) const;
  // How many arguments for_each_argument visits: the length of RoPE's part of a schema.
  static int argument_count();

  int64_t n_axes() const { return sections.empty() ? 1 : static_cast<int64_t>(sections.size()); }
  bool multi_axis() const { return !sections.empty(); }
  // The int offset, for a backend (a concrete SymInt there).
  int64_t concrete_offset() const { return offset.guard_int(__FILE__, __LINE__); }
  int64_t concrete_seq_len() const { return seq_len.guard_int(__FILE__, __LINE__); }
  // For the ops whose schema requires k (qk_norm_rope, rope_append_kv): a ValueError naming
  // `op` when k is absent (an undefined tensor from C++ reads as None), before a kernel reads it.
  void require_k(const char* op) const;
};

// The parsers RopeCall::pop uses, for ops with other argument lists (rope_frequencies).
math::RopeScalingParams parse_rope_scaling(const std::string& rope_type,
                                           const std::vector<double>& values);
math::RopeSectionsMode parse_rope_sections_mode(const std::string& name);
// A scaling type by its Hugging Face name (ValueError naming the accepted ones).
math::RopeType parse_rope_type(const std::string& name);
RopeLayout parse_rope_layout(const std::string& name);

// Names, for messages and for Python (posenc::rope_scaling_spec).
const char* rope_layout_name(RopeLayout layout);
const char* rope_type_name(math::RopeType type);
std::vector<std::string> rope_type_names();
std::vector<std::string> rope_scaling_keys();
std::vector<std::string> rope_scaling_list_keys();

// Where a layout keeps batch, sequence and heads: their dims in q or k (head_dim is last).
// batch -1: none ('thd' packs its sequences into one token dim). The one statement of the
// layouts' geometry: the canonical views below, the C++ module and Python (through
// posenc::rope_scaling_spec: _rope.LAYOUT_AXES, posenc.distributed) read it.
struct RopeLayoutAxes {
  int64_t batch, seq, heads;
};
RopeLayoutAxes rope_layout_axes(RopeLayout layout);

// (batch, seq, heads, head_dim) view of q or k, whatever the layout: no copy; and back.
at::Tensor rope_canonical_view(const at::Tensor& x, RopeLayout layout);
at::Tensor rope_from_canonical(const at::Tensor& x, RopeLayout layout);

// The boxed op calls every C++ caller goes through (C++ API, autograd): rope returns
// (q, k or an empty tensor), rope_ rotates in place, rope_position_bounds reads bounds,
// rope_rotary_width checks the settings and resolves the rotary width.
std::tuple<at::Tensor, at::Tensor> call_rope(const RopeCall& call);
void call_rope_inplace(const RopeCall& call);
// The call applied to (a, b) as its q and k, either of which may be undefined (a zero
// gradient or tangent: autograd's derivatives of the rotation, which is linear): the rotated
// pair, undefined where the input was. One fused launch when both are defined; a lone b is
// rotated as the call's q (q and k share batch, sequence and positions); two dtypes a call each
// (autograd::call_pair).
std::pair<at::Tensor, at::Tensor> call_rope_pair(RopeCall call, const at::Tensor& a, const at::Tensor& b);
std::tuple<int64_t, int64_t> call_rope_position_bounds(const RopeCall& call);
// The features the call rotates (rotary_dim resolved), after its checks: rope_rotary_width.
int64_t call_rope_rotary_width(const RopeCall& call);

// The names the RoPE ops accept and the facts of each scaling type, for Python (the op
// rope_scaling_spec, defined with rope's schemas in rope/rope.cpp): (rope types, scaling
// keys, layouts, sections modes, list-valued scaling keys), then (fact names, one int per
// type whose bit i is fact i), from POSENC_ROPE_TYPE_FACTS and POSENC_ROPE_TYPES
// (posenc/math/rope.h), then the layouts' (batch, seq, heads) dims, 3 per layout, then the
// largest position magnitude the ops take (kRopeMaxPosition), then the keys each type reads
// (one int per type whose bit i is scaling key i: POSENC_ROPE_TYPES' keys column).
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>,
           std::vector<std::string>, std::vector<std::string>, std::vector<std::string>,
           std::vector<int64_t>, std::vector<int64_t>, int64_t, std::vector<int64_t>>
rope_scaling_spec();

// Fails when the schema of `op` and RopeCall::for_each_argument disagree (registration).
void check_rope_schema_matches(const c10::FunctionSchema& schema);

}  // namespace ops

// The C++ API's options as the op's parsed call: one translation, shared by the C++
// functions and modules of rope, qk_norm_rope and rope_append_kv (defined in api/rope.cpp).
namespace detail {

// The op's view of a C++ API call (positions, offsets, scaling... from the options).
ops::RopeCall make_rope_call(const at::Tensor& q, const std::optional<at::Tensor>& k,
                             const ApplyRopeOptions& o, int64_t seq_len);

// A module call's positions, offset(s) and cu_seqlens into the op's call (undefined index
// tensors absent: ops::optional_tensor); its seq_len is the caller's.
void set_rope_positions(ops::RopeCall& call, const RopePositions& where);

// The op's seq_len for a type that scales by length (math::rope_scales_by_length): the
// given one (>= 0: a ValueError otherwise), else -1 (the op reads the call's longest
// position); 0 for the other types.
int64_t rope_seq_len_argument(const RopeScaling& s, std::optional<int64_t> seq_len = std::nullopt);

}  // namespace detail
}  // namespace posenc
