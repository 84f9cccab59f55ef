// The RoPE ops composed from ATen ops, for backends without a RoPE kernel (the ATen
// fallback, aten_fallback.h): rope, rope_ and apply_rope_cos_sin under
// CompositeExplicitAutograd. rope goes through the same boxed body, checks and launch
// preparation as the kernels (rope_launch.h: frequencies, positions, index checks), then
// computes each token's angles pos * inv_freq in float64 (float32 on MPS), cos and sin with
// the device's functions, and the rotation in float32 (float64 for float64), rounded once.
// Packed tokens outside every sequence get NaN rows, as in the kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ops/common/aten_fallback.h"
#include "ops/rope_cos_sin/rope_cos_sin.h"
#include "ops/common/rope_launch.h"

namespace posenc {
namespace ops {
namespace {

at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// (x1, x2) of the rotary pairs of x's last dimension, as math::rope_pair_features pairs
// them: halves (p, p + rot / 2), or adjacent (2p, 2p + 1) when interleaved.
std::pair<at::Tensor, at::Tensor> split_pairs(const at::Tensor& x, int64_t rot, bool interleaved) {
  const at::Tensor r = x.narrow(-1, 0, rot);
  if (interleaved) {
    const at::Tensor v = r.unflatten(-1, {rot / 2, 2});
    return {v.select(-1, 0), v.select(-1, 1)};
  }
  return {r.narrow(-1, 0, rot / 2), r.narrow(-1, rot / 2, rot / 2)};
}

// x (batch, seq, heads, head_dim) rotated pair by pair in the compute dtype acc:
//   forward    y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
//   transpose  y1 = x1 c1 + x2 s2,   y2 = x2 c2 - x1 s1
// (math::rope_rotate_pair_tables), rounded once to x's dtype; features beyond rot pass
// through.
at::Tensor rotate_composite(const at::Tensor& x, const at::Tensor& c1, const at::Tensor& s1,
                            const at::Tensor& c2, const at::Tensor& s2, int64_t rot,
                            bool interleaved, bool transpose, at::ScalarType acc) {
  const auto [x1, x2] = split_pairs(x.to(acc), rot, interleaved);
  const at::Tensor y1 = transpose ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1;
  const at::Tensor y2 = transpose ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2;
  at::Tensor y = (interleaved ? at::stack({y1, y2}, -1).flatten(-2) : at::cat({y1, y2}, -1))
                     .to(x.scalar_type());
  const int64_t d = x.size(-1);
  if (rot < d) y = at::cat({y, x.narrow(-1, rot, d - rot)}, -1);
  return y;
}

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
  const at::ScalarType acc = compute_dtype(q);
  const double factor = a.attention_factor;
  const at::Tensor cos = (at::cos(angle) * factor).to(acc).unsqueeze(2);
  const at::Tensor sin = (at::sin(angle) * (a.inverse ? -factor : factor)).to(acc).unsqueeze(2);
  for (const auto& [in, out] : {std::pair<const at::Tensor*, const at::Tensor*>{&launch.q_in, &launch.q_out},
                                {&launch.k_in, &launch.k_out}}) {
    if (!in->defined()) continue;
    at::Tensor y = rotate_composite(*in, cos, sin, cos, sin, a.rotary_dim, a.interleaved,
                                    /*transpose=*/false, acc);
    if (valid.defined()) {
      y = at::where(valid.view({valid.size(0), seq, 1, 1}), y,
                    std::numeric_limits<double>::quiet_NaN());
    }
    out->copy_(y);
  }
}

// Outputs like their input (its strides when dense), as the CPU kernel's.
at::Tensor empty_output_composite(const at::Tensor& like) {
  return at::empty_like(like, at::MemoryFormat::Preserve);
}

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_composite(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  const bool bhsd = check_rope_cos_sin(q, k, cos, sin, std::string(layout));
  warn_aten_fallback("apply_rope_cos_sin", q.device());
  const at::ScalarType acc = compute_dtype(q);
  const int64_t rot = cos.size(-1);
  // The tables as (1 or batch, seq, 1, rot) in the compute dtype, split like the features.
  const auto table = [&](const at::Tensor& t) {
    const at::Tensor v = t.to(acc);
    return (v.dim() == 2 ? v.unsqueeze(0) : v).unsqueeze(2);
  };
  const auto [c1, c2] = split_pairs(table(cos), rot, interleaved);
  const auto [s1, s2] = split_pairs(table(sin), rot, interleaved);
  const auto rotate = [&](const at::Tensor& x) {
    const auto canonical = [bhsd](const at::Tensor& t) { return bhsd ? t.transpose(1, 2) : t; };
    at::Tensor out = empty_output_composite(x);
    canonical(out).copy_(
        rotate_composite(canonical(x), c1, s1, c2, s2, rot, interleaved, transpose, acc));
    return out;
  };
  return {rotate(q), k.has_value() ? rotate(*k) : at::empty({0}, q.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<
                     &rope_kernel_boxed<&empty_output_composite, &run_rope_composite>>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<
                      &rope_inplace_kernel_boxed<&empty_output_composite, &run_rope_composite>>());
  m.impl("apply_rope_cos_sin", &apply_rope_cos_sin_composite);
}

}  // namespace ops
}  // namespace posenc
