// From a checked RopeCall to a kernel launch: the frequencies of the call, outputs, the
// kernel parameters (RopeArgs), and the boxed kernel body every backend shares.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

#include "ops/common/rope_args.h"
#include "ops/common/rope_call.h"

namespace posenc {
namespace ops {

// The per-pair frequencies of a checked configuration (check_rope_structure and
// check_rope_settings, or the rope_frequencies op's checks), with the position axis of each
// pair and the factor on cos and sin. Raises when extreme settings give a frequency that is
// not finite and positive.
struct RopePairFrequencies {
  std::vector<double> inv_freq;
  std::vector<uint8_t> axis;
  double attention_factor = 1.0;
};
RopePairFrequencies rope_pair_frequencies(int64_t rotary_dim, double base,
                                          const math::RopeScalingParams& scaling, int64_t seq_len,
                                          const std::vector<int64_t>& sections,
                                          math::RopeSectionsMode sections_mode);

// (smallest, largest) position of the call over every axis, exactly; (0, -1) when it
// rotates no token. One read back to the host when an index tensor is given (a device sync
// for CUDA tensors), none otherwise; the values read are domain-checked. For a call that
// passed check_rope_structure. rope_position_bounds.cpp.
std::tuple<int64_t, int64_t> rope_position_bounds_of(const RopeCall& call);

// A call of a type that scales by length ("dynamic", "longrope") with seq_len -1 (read from
// the call) gets the longest position + 1 as its seq_len, read once here: for the autograd
// wrappers, whose forward, backward and tangent are separate calls that would each read it
// (on CUDA a device sync each). Only for index tensors whose values can be read (CPU or CUDA,
// not a fake, functional or batched wrapper: those calls are left to the kernels). Validates
// the call first, as the op would. rope_position_bounds.cpp.
void resolve_rope_seq_len(RopeCall& call);

// One of q and k for a kernel: input and output pointers and strides of their
// (batch, seq, heads, head_dim) views (rope_canonical_view); shared with apply_rope_cos_sin.
void fill_rope_operand(RopeOperand& op, const at::Tensor& in, const at::Tensor& out);

// Everything a kernel launch needs, with the small index tensors it points into kept alive.
struct RopeLaunch {
  RopeArgs args;
  // Contiguous int64 copies (or the originals); cu_seqlens stays int32 on CUDA.
  at::Tensor positions, offsets, cu_seqlens;
  // The (batch, seq, heads, head_dim) views args.q and args.k point into (k's undefined
  // without k): what the ATen fallback (rope_composite.cpp), which works on tensors, reads.
  at::Tensor q_in, q_out, k_in, k_out;
};

// The kernel parameters of a checked call (check_rope_structure, which gave rot, its resolved
// rotary_dim, and check_rope_settings); out_q/out_k are where the kernel writes (q and k
// themselves in place). CPU index values are domain-checked here. Also rope_append_kv's.
RopeLaunch prepare_rope_launch(const RopeCall& c, int64_t rot, const at::Tensor& out_q,
                               const std::optional<at::Tensor>& out_k);

// A backend: how it allocates outputs like an input, and how it launches (on q's device,
// with q's dtype; the CUDA one sets the device guard itself).
using RopeOutputAllocator = at::Tensor (*)(const at::Tensor& like);
// The CUDA backends' allocator (the CPU ones use cpu_support.h's empty_output_like).
inline at::Tensor empty_like_input(const at::Tensor& like) { return at::empty_like(like); }
using RopeKernelRunner = void (*)(const RopeLaunch& launch, const at::Tensor& q);

// The body of the boxed rope / rope_ kernels of every backend: pop the call, check it
// (before anything touches a device), allocate (out of place), prepare, launch, push the
// results.
void run_rope_boxed(torch::jit::Stack* stack, bool in_place, RopeOutputAllocator allocate,
                    RopeKernelRunner run);

template <RopeOutputAllocator Allocate, RopeKernelRunner Run>
void rope_kernel_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_rope_boxed(stack, /*in_place=*/false, Allocate, Run);
}
template <RopeOutputAllocator Allocate, RopeKernelRunner Run>
void rope_inplace_kernel_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_rope_boxed(stack, /*in_place=*/true, Allocate, Run);
}

}  // namespace ops
}  // namespace posenc
