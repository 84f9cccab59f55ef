// rope_shift_kv: rotate cached keys in place from the positions they were written at to new
// ones (context shifting, llama.cpp's K-shift; attention sinks, StreamingLLM; re-using cached
// segments at other offsets). This header is the family's host side: the parsed call, its
// checks, the launch preparation shared by the CPU and CUDA kernels (rope_shift_kv.cpp); the
// kernels' plain data, RopeShiftKvArgs, is in cpu/kernel.h.
//
// Schema (rope_shift_kv.cpp):
//   rope_shift_kv_(Tensor(a!) k_cache, Tensor from_positions, Tensor to_positions,
//                  Tensor? rows=None, Tensor? slot_mapping=None, Tensor? k_scale=None,
//                  SymInt? from_seq_len=None, SymInt? to_seq_len=None,
//                  <RoPE's configuration>) -> ()
// <RoPE's configuration> is the configuration part of RoPE's schema tail (kRopeSchemaArguments:
// base, rope_type, scaling, rotary_dim, interleaved, layout, sections, sections_mode and the
// plain settings of POSENC_ROPE_SETTINGS), cut from that tail at registration, so a new
// setting of RoPE reaches this op with no edit here; it is read by RopeCall::pop. Why not the
// whole tail: a RopeCall holds one set of positions (positions / offsets / offset /
// cu_seqlens) and one seq_len, for one rotation; a shift needs two of each (the angle a key
// was written at, the angle it must have), and the "from" and "to" positions are the op's
// own arguments. The two ends are then two RopeCalls with the one configuration
// (RopeShiftKvCall::end), each checked and turned into RopeArgs by RoPE's own code
// (check_rope_structure, prepare_rope_launch): the same frequencies, seq_len rule and
// position checks as rope's.
//
// The rotation of a row is the `to` end's angle at its new position minus the `from` end's
// at its old one, pair by pair (not a rotation by the position difference: dynamic NTK's
// frequencies depend on seq_len, longrope switches factors by length), times the ratio of
// the ends' attention factors (1: the cached keys already carry yarn's or longrope's).
//
// Layouts: "bshd" (cache (batch, max_len, kv_heads, head_dim)) and "bhsd" ((batch, kv_heads,
// max_len, head_dim)): rows int64 (n,) or (batch, n), the cache rows turned (default
// 0 .. n-1), positions (n,) or (batch, n). "thd": paged cache (num_blocks, block_size,
// kv_heads, head_dim), slot_mapping int64 (n,) (-1: not turned), positions (n,).
// from_seq_len / to_seq_len: the length each end's length-scaled type ("dynamic",
// "longrope") scaled for; None: the longest of its positions + 1 (a device sync for device
// positions, as rope's seq_len=-1).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

#include "ops/common/rope_call.h"
#include "ops/common/rope_launch.h"
#include "ops/rope_shift_kv/cpu/kernel.h"

namespace posenc {
namespace ops {

struct RopeShiftKvCall {
  at::Tensor k_cache, from_positions, to_positions;
  std::optional<at::Tensor> rows, slot_mapping, k_scale;
  std::optional<c10::SymInt> from_seq_len, to_seq_len;
  // The configuration (base, scaling, rotary_dim, interleaved, layout, sections, plain
  // settings); its q, k, positions, offsets, offset, cu_seqlens, seq_len and inverse unused.
  RopeCall config;

  // Pops a boxed call of rope_shift_kv_ (the whole schema); pushes one (the C++ API).
  static RopeShiftKvCall pop(torch::jit::Stack& stack);
  void push(torch::jit::Stack& stack) const;

  bool paged() const { return config.layout == RopeLayout::kTHD; }
  // Items as RoPE sees them: (batch, n) (paged: batch 1, n slots).
  int64_t batch() const;
  int64_t n() const;
  // One end of the rotation as a RoPE call over the items: a stand-in q (batch, n, kv_heads,
  // head_dim) of no memory, layout "bshd", the end's positions and seq_len (None: -1 for a
  // length-scaled type, which prepare_rope_launch reads from the positions).
  RopeCall end(bool to) const;
};

// Every check that needs no tensor value (shapes, dtypes, devices, settings); works on Meta
// tensors. Returns the resolved rotary_dim.
int64_t check_rope_shift_kv(const RopeShiftKvCall& call);
// The values, for CPU index tensors: every row or slot lies in the cache (IndexError naming
// the argument and the item, before anything is written), none is listed twice (ValueError:
// it would turn twice), positions within [-2**53, 2**53]; and the memory: the cache shares no
// byte with itself or an index tensor (check_written_memory).
void check_rope_shift_kv_values(const RopeShiftKvCall& call);
void check_rope_shift_kv_overlap(const RopeShiftKvCall& call);

// The boxed op call of the C++ API.
void call_rope_shift_kv(const RopeShiftKvCall& call);

struct ShiftKvLaunch {
  RopeShiftKvArgs args;
  RopeLaunch from, to;  // keep the ends' index tensors alive
  at::Tensor rows, slot_mapping;
};

// The kernel parameters of a checked call (rot: its resolved rotary_dim).
ShiftKvLaunch prepare_shift_kv_launch(const RopeShiftKvCall& call, int64_t rot);

}  // namespace ops
}  // namespace posenc
