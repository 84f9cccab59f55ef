// The rope op family's host side: the schemas of rope, rope_, rope_position_bounds(/_extremes) and
// rope_scaling_spec; the Meta kernels; the ATen composite (devices without a kernel); the
// CPU and CUDA registrations. The call they all read is RopeCall (common/rope_call.h); the checks and
// the launch preparation shared with qk_norm_rope and rope_append_kv are in common/.
#include <ATen/ATen.h>
#include <limits>
#include <string>
#include <torch/library.h>
#include <utility>
#include <vector>

#include "ops/common/aten_fallback.h"
#include "ops/common/cpu/cpu_support.h"
#include "ops/common/meta_support.h"
#include "ops/common/rope_call.h"
#include "ops/common/rope_checks.h"
#include "ops/common/rope_launch.h"
#include "ops/rope/cpu/kernel.h"
#include "ops/common/rope_composite.h"

// ---- Schemas

namespace posenc {
namespace ops {

// The schemas of the RoPE ops (their arguments after q, k are RopeCall's, common/rope_call.h):
//   rope                  q (and k) rotated, out of place: (q, k or an empty tensor); its
//                         backward is the same op with inverse=True.
//   rope_                 the same rotation in place (inference).
//   rope_position_bounds  (smallest, largest) position a call rotates ((0, -1): none),
//                         read back to the host; the modules' range check.
//   rope_position_extremes  the same bounds as an int64 tensor (2,) on q's device, not
//                         read back (hi < lo: none); the modules' range check under
//                         torch.compile, torch.export and torch.jit.trace.
//   rope_rotary_width     how many features of a head the call rotates (rotary_dim
//                         resolved: head_dim - rotary_offset, or 2 * sum(sections)), after
//                         the call's checks: the one statement of that rule, which the
//                         modules ask for at construction (an empty q suffices).
//   rope_scaling_spec     the names the ops accept, the facts and keys of the scaling
//                         types and the position range, for Python (rope_call.h).
TORCH_LIBRARY_FRAGMENT(posenc, m) {
  const std::string tail = kRopeSchemaArguments;
  m.def(("rope(Tensor q, Tensor? k=None, " + tail + ") -> (Tensor, Tensor)").c_str());
  m.def(("rope_(Tensor(a!) q, Tensor(b!)? k=None, " + tail + ") -> ()").c_str());
  m.def(("rope_position_bounds(Tensor q, Tensor? k=None, " + tail + ") -> (int, int)").c_str());
  m.def(("rope_position_extremes(Tensor q, Tensor? k=None, " + tail + ") -> Tensor").c_str());
  m.def(("rope_rotary_width(Tensor q, Tensor? k=None, " + tail + ") -> int").c_str());
  m.def("rope_scaling_spec() -> (str[], str[], str[], str[], str[], str[], int[], int[], int, int[])",
        &rope_scaling_spec);
}


}  // namespace ops
}  // namespace posenc

// ---- Meta kernels
// Meta kernels of rope and rope_: the real kernels' checks, and q's (and k's) shape and
// strides as the backends allocate them (empty_like), with symbolic sizes, so torch.compile
// and torch.export trace them without running them.
namespace posenc {
namespace ops {
namespace {

RopeCall checked_meta_call(const char* op, torch::jit::Stack* stack) {
  RopeCall c = RopeCall::pop(*stack);
  check_rope_structure(c);
  check_not_mixed_with_meta(op, {{"q", &c.q}, {"k", optional_ptr(c.k)},
                                 {"positions", optional_ptr(c.positions)},
                                 {"offsets", optional_ptr(c.offsets)},
                                 {"cu_seqlens", optional_ptr(c.cu_seqlens)}});
  check_rope_settings(c);
  return c;
}

void rope_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeCall c = checked_meta_call("rope", stack);
  stack->emplace_back(at::empty_like(c.q));
  stack->emplace_back(c.k.has_value() ? at::empty_like(*c.k) : at::empty({0}, c.q.options()));
}

void rope_inplace_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  check_rope_inplace(checked_meta_call("rope_", stack));
}

void rope_position_extremes_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeCall c = checked_meta_call("rope_position_extremes", stack);
  stack->emplace_back(at::empty({2}, c.q.options().dtype(at::kLong)));
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<&rope_meta>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<&rope_inplace_meta>());
  m.impl("rope_position_extremes", torch::CppFunction::makeFromBoxedFunction<&rope_position_extremes_meta>());
}

}  // namespace ops
}  // namespace posenc

// ---- The ATen composite
// The RoPE ops composed from ATen ops, for backends without a RoPE kernel (the ATen
// fallback, aten_fallback.h): rope and rope_ under
// CompositeExplicitAutograd. rope goes through the same boxed body, checks and launch
// preparation as the kernels (rope_launch.h: frequencies, positions, index checks), then
// computes each token's angles pos * inv_freq in float64 (float32 on MPS), cos and sin with
// the device's functions, and the rotation in float32 (float64 for float64), rounded once.
// Packed tokens outside every sequence get NaN rows, as in the kernels.
namespace posenc {
namespace ops {
namespace {

// The rope / rope_ runner (rope_launch.h's RopeKernelRunner) over the launch's tensors.
void run_rope_composite(const RopeLaunch& launch, const at::Tensor& q) {
  warn_aten_fallback("rope", q.device());
  const RopeArgs& a = launch.args;
  const int64_t batch = a.batch, seq = a.seq, axes = a.n_axes, half = a.rotary_dim / 2;
  if (batch * seq == 0) return;
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(q.device());
  const at::Tensor s = at::arange(seq, long_options).view({1, seq});
  const at::Tensor b = at::arange(batch, long_options).view({batch, 1});
  // Each token's shift, restart (packed: the index its sequence starts at) and validity,
  // (1 or batch, seq): rope_token_shift.
  at::Tensor shift = at::full({1, 1}, a.offset, long_options);
  at::Tensor restart = at::zeros({1, 1}, long_options);
  at::Tensor valid;
  if (launch.cu_seqlens.defined()) {
    const at::Tensor cu = launch.cu_seqlens.to(at::kLong);
    // The sequence j with cu[j] <= s < cu[j + 1] (math::rope_sequence_of); none past the end.
    const at::Tensor j = at::searchsorted(cu, s, /*out_int32=*/false, /*right=*/true) - 1;
    valid = j.ge(0).logical_and(j.lt(a.num_seqs));
    if (a.num_seqs > 0) {
      const at::Tensor jc = j.clamp(0, a.num_seqs - 1).reshape({-1});
      restart = cu.index_select(0, jc).view_as(j);
      if (launch.offsets.defined()) shift = shift + launch.offsets.index_select(0, jc).view_as(j);
    }
  } else if (launch.offsets.defined()) {
    shift = shift + launch.offsets.view({batch, 1});
  }
  // Coordinate of every token on every axis, (batch, seq, axes): rope_axis_position.
  at::Tensor pos;
  if (launch.positions.defined()) {
    const at::Tensor axis = at::arange(axes, long_options).view({1, 1, axes});
    const at::Tensor index = axis * a.positions_axis_stride +
                             b.unsqueeze(-1) * a.positions_batch_stride + s.unsqueeze(-1);
    pos = launch.positions.reshape({-1}).index_select(0, index.reshape({-1})).view(index.sizes());
  } else {
    pos = (s - restart).unsqueeze(-1);
  }
  pos = (pos + shift.unsqueeze(-1)).expand({batch, seq, axes});
  // Each pair's position and angle, (batch, seq, half).
  const at::Tensor pair_axis =
      at::tensor(std::vector<int64_t>(a.pair_axis, a.pair_axis + half), at::kLong).to(q.device());
  const at::ScalarType wide = fallback_wide_dtype(q.device());
  const at::Tensor inv_freq =
      at::tensor(std::vector<double>(a.inv_freq, a.inv_freq + half), at::kDouble)
          .to(q.device(), wide);
  const at::Tensor angle = pos.index_select(-1, pair_axis).to(wide) * inv_freq;
  const at::ScalarType acc = composite::compute_dtype(q);
  const double factor = a.attention_factor;
  const at::Tensor cos = (at::cos(angle) * factor).to(acc).unsqueeze(2);
  const at::Tensor sin = (at::sin(angle) * (a.inverse ? -factor : factor)).to(acc).unsqueeze(2);
  for (const auto& [in, out] : {std::pair<const at::Tensor*, const at::Tensor*>{&launch.q_in, &launch.q_out},
                                {&launch.k_in, &launch.k_out}}) {
    if (!in->defined()) continue;
    at::Tensor y = composite::rotate_composite(*in, cos, sin, cos, sin, a.rotary_dim, a.interleaved,
                                    /*transpose=*/false, acc, math::rope_rotary_begin(a.settings));
    if (valid.defined()) {
      y = at::where(valid.view({valid.size(0), seq, 1, 1}), y,
                    std::numeric_limits<double>::quiet_NaN());
    }
    out->copy_(y);
  }
}

at::Tensor empty_output_composite(const at::Tensor& like) { return composite::empty_output(like); }

void rope_rotary_width_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeCall c = RopeCall::pop(*stack);
  check_rope_settings(c);
  stack->emplace_back(check_rope_structure(c));
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  // Shapes and settings only: one kernel for every backend, Meta included.
  m.impl("rope_rotary_width", torch::CppFunction::makeFromBoxedFunction<&rope_rotary_width_boxed>());
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<
                     &rope_kernel_boxed<&empty_output_composite, &run_rope_composite>>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<
                      &rope_inplace_kernel_boxed<&empty_output_composite, &run_rope_composite>>());
}

}  // namespace ops
}  // namespace posenc

// ---- CPU
// CPU backend of the rope ops: the shared boxed body (common/rope_launch.h) with outputs
// from empty_output_like (cpu_support.h: torch's allocator), and the call of the
// vectorised kernel in cpu/kernel.cpp (built
// once per vector ISA, chosen at run time: cpu_capability.h).
namespace posenc {
namespace ops {
namespace {

void run_rope_cpu(const RopeLaunch& launch, const at::Tensor& q) {
  cpu::rope_stub::get()(launch.args, q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<
                     &rope_kernel_boxed<&empty_output_like, &run_rope_cpu>>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<
                      &rope_inplace_kernel_boxed<&empty_output_like, &run_rope_cpu>>());
}

}  // namespace ops
}  // namespace posenc

// ---- CUDA
// CUDA backend of the rope ops: the same boxed body with outputs from empty_like, and the
// launch of cuda/rope/rope.cu's kernels on q's device and current stream.
#if defined(POSENC_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/rope/launch.h"

namespace posenc {
namespace ops {
namespace {

void run_rope_cuda(const RopeLaunch& launch, const at::Tensor& q) {
  const c10::cuda::CUDAGuard guard(q.device());  // current stream and properties of q's GPU
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "posenc_rope_cuda", [&] {
    C10_CUDA_CHECK(launch_rope<scalar_t>(launch.args, at::cuda::getCurrentCUDAStream()));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<
                     &rope_kernel_boxed<&empty_like_input, &run_rope_cuda>>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<
                      &rope_inplace_kernel_boxed<&empty_like_input, &run_rope_cuda>>());
}

}  // namespace ops
}  // namespace posenc
#endif  // POSENC_WITH_CUDA
