// Validation of a RoPE call, shared by the CPU, CUDA and Meta kernels so that every backend
// rejects the same inputs with the same message (each names the argument, its value and
// what was expected). Parsing is RopeCall::pop's job; these check what was parsed.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>

#include "ops/common/rope_args.h"  // kMaxRopePairs
#include "ops/common/rope_call.h"

namespace posenc {
namespace ops {

// Shapes, dtypes and devices of q, k and the index tensors, rotary_dim and sections. Works
// on Meta tensors (symbolic sizes). Returns the resolved rotary_dim (head_dim for -1).
int64_t check_rope_structure(const RopeCall& call);

// The index arguments against q (and sections): 'thd' needs cu_seqlens, and positions only
// with sections; dtypes, devices and shapes. Works on Meta tensors.
void check_rope_indices(const RopeCall& call);

// The settings that need no tensor: base, the scaling keys the type needs, the int offset's
// domain (when concrete), seq_len. Works on Meta tensors.
void check_rope_settings(const RopeCall& call);

// Scaling keys for their type (e.g. llama3 needs high_freq_factor > low_freq_factor).
void check_rope_scaling(const math::RopeScalingParams& scaling);
// The list keys against the resolved rotary_dim (longrope: rotary_dim / 2 values each, one
// position axis).
void check_rope_scaling_lists(const math::RopeScalingParams& scaling, int64_t rotary_dim,
                              bool multi_axis);
void check_rope_base(double base);
// rotary_dim / 2 <= kMaxRopePairs: the kernels stage a token's pairs in fixed arrays (CPU
// stack, CUDA shared memory and threads per block). Every RoPE op (rope, rope_frequencies,
// apply_rope_cos_sin) refuses a larger one with this message, on every device.
void check_rope_rotary_dim_supported(int64_t rotary_dim);
// sections for rotary_dim (even, resolved): 1..kRopeMaxAxes positive counts summing to
// rotary_dim / 2 (interleaved M-RoPE: axis a >= 1's last pair, a + n_axes * (sections[a] - 1),
// below rotary_dim / 2).
void check_rope_sections(const std::vector<int64_t>& sections, math::RopeSectionsMode mode,
                         int64_t rotary_dim);

// Positions, offsets and the int offset must each lie in [-2**53, 2**53] (kRopeMaxPosition,
// rope_args.h). ValueError naming `what`.
void check_rope_position_value(const char* what, int64_t value);

// Memory that a kernel writes while it reads other tensors (written_memory.cpp). A kernel
// computes the right answer only when nothing it writes shares a byte with anything else it
// reads or writes: the checks below refuse every call where that is not proven ("cannot
// tell" is a refusal).
//
// Whether a and b provably share no byte: empty tensors do not; otherwise their byte spans
// [lowest, highest element] are disjoint (one storage, or two of which one is private memory,
// written_memory.cpp's private_memory: two host storages torch's CPU allocator did not make,
// from_blob, DLPack, numpy, a file mapped twice, may be one memory at two addresses; storages
// without an address, Meta or wrapper subclasses, are their own memory),
// at::get_overlap_status proves them apart, or their addresses
// modulo one of their byte strides fall in disjoint intervals (slices of one buffer whose
// rows or heads interleave: a fused qkv projection, k and v caches in one buffer).
bool provably_disjoint(const at::Tensor& a, const at::Tensor& b);
// Whether no two elements of t share a byte: at::has_internal_overlap, and for the views it
// cannot decide, strides that, sorted, each pass every offset the smaller ones reach.
bool provably_no_internal_overlap(const at::Tensor& t);

// One tensor argument of a call, by name; a null tensor is an absent optional argument.
struct MemoryOperand {
  const char* name = nullptr;
  const at::Tensor* tensor = nullptr;
};
// Refuses the call unless each `written` tensor provably has no internal overlap and is
// provably disjoint from every other written and every `read` tensor: RuntimeError naming
// both arguments ("<op>: expected <a> and <b> in separate memory ..."), ending in `remedy`.
// The one check of every op that writes (rope_, qk_norm_rope_, rope_append_kv(_)), on every
// backend and the ATen fallback.
void check_written_memory(const char* op, std::initializer_list<MemoryOperand> written,
                          std::initializer_list<MemoryOperand> read, const char* remedy);

// In place (rope_): q and k are written, positions, offsets and cu_seqlens read; none may
// share memory with another, nor q or k with itself (slices of one fused qkv buffer are
// fine). written_memory.cpp.
void check_rope_inplace(const RopeCall& call);

}  // namespace ops
}  // namespace posenc
