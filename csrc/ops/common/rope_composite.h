// Pieces of the RoPE ops' ATen composites (the kernels of devices without a RoPE kernel,
// aten_fallback.h), shared by rope's (rope/rope.cpp) and apply_rope_cos_sin's
// (rope_cos_sin/rope_cos_sin.cpp).
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace posenc {
namespace ops {
namespace composite {

inline at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// (x1, x2) of the rotary pairs of x's last dimension, as math::rope_pair_features pairs
// them: halves (p, p + rot / 2), or adjacent (2p, 2p + 1) when interleaved.
inline std::pair<at::Tensor, at::Tensor> split_pairs(const at::Tensor& x, int64_t rot, bool interleaved,
                                              int64_t begin = 0) {
  const at::Tensor r = x.narrow(-1, begin, rot);
  if (interleaved) {
    const at::Tensor v = r.unflatten(-1, {rot / 2, 2});
    return {v.select(-1, 0), v.select(-1, 1)};
  }
  return {r.narrow(-1, 0, rot / 2), r.narrow(-1, rot / 2, rot / 2)};
}

// x (batch, seq, heads, head_dim) rotated pair by pair in the compute dtype acc:
//   forward    y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
//   transpose  y1 = x1 c1 + x2 s2,   y2 = x2 c2 - x1 s1
// (math::rope_rotate_pair_tables), rounded once to x's dtype; the features outside
// [begin, begin + rot) pass through.
inline at::Tensor rotate_composite(const at::Tensor& x, const at::Tensor& c1, const at::Tensor& s1,
                            const at::Tensor& c2, const at::Tensor& s2, int64_t rot,
                            bool interleaved, bool transpose, at::ScalarType acc,
                            int64_t begin = 0) {
  const auto [x1, x2] = split_pairs(x.to(acc), rot, interleaved, begin);
  const at::Tensor y1 = transpose ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1;
  const at::Tensor y2 = transpose ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2;
  at::Tensor y = (interleaved ? at::stack({y1, y2}, -1).flatten(-2) : at::cat({y1, y2}, -1))
                     .to(x.scalar_type());
  const int64_t d = x.size(-1);
  if (begin > 0) y = at::cat({x.narrow(-1, 0, begin), y}, -1);
  if (begin + rot < d) y = at::cat({y, x.narrow(-1, begin + rot, d - begin - rot)}, -1);
  return y;
}


// Outputs like their input (its strides when dense), as the CPU kernels'.
inline at::Tensor empty_output(const at::Tensor& like) {
  return at::empty_like(like, at::MemoryFormat::Preserve);
}

}  // namespace composite
}  // namespace ops
}  // namespace posenc
