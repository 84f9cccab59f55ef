// CPU kernel of rope_shift_kv_. Items (batch row, row turned) are spread over threads
// (at::parallel_for); each item's turn is computed once (both ends' cos/sin by RoPE's own
// token_angles, combined by rope_shift_angle) and serves every head of its cache row, which
// is rotated in place by RoPE's row rotation (at::vec for contiguous rows). FP8 rows are
// dequantised into a float32 staging row, rotated, and quantised back with the same scale.
// One read and one write of each row turned; nothing else is touched.
#include "ops/rope_shift_kv/cpu/kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "ops/common/cpu/rope_rows.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace {

template <typename scalar_t>
void shift_rows(const RopeShiftKvArgs& a) {
  using acc_t = at::opmath_type<scalar_t>;
  const RopeArgs& g = a.to;  // the row geometry (head_dim, rotary_dim, pairs, offset)
  const int64_t half = g.rotary_dim / 2;
  const int64_t items = g.batch * g.seq;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, a.heads * g.head_dim));
  const int64_t begin = math::rope_rotary_begin(g.settings);
  const bool fp8 = a.format != KvCacheFormat::kSame;
  // The FP8 path rotates a staging row of the rotary features alone: the geometry from 0.
  RopeArgs staged = g;
  staged.settings.rotary_offset = 0;
  staged.head_dim = g.rotary_dim;
  const int64_t* st = a.cache_stride;
  at::parallel_for(0, items, grain, [&](int64_t first, int64_t last) {
    TokenAngles<acc_t> old_angles, new_angles, turn;
    int64_t p_old[math::kRopeMaxAxes], p_new[math::kRopeMaxAxes];
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / g.seq, j = item % g.seq;
      int64_t outer = 0, inner = 0;
      if (!shift_kv_row(a, b, j, &outer, &inner)) continue;  // slot -1
      token_positions(a.from, b, j, p_old);
      token_positions(a.to, b, j, p_new);
      token_angles<acc_t>(a.from, p_old, old_angles, false);
      token_angles<acc_t>(a.to, p_new, new_angles, false);
      const acc_t factor = static_cast<acc_t>(a.factor);
      for (int64_t i = 0; i < half; ++i) {
        rope_shift_angle<acc_t>(new_angles.cs[i], new_angles.sn[i], old_angles.cs[i], old_angles.sn[i],
                                factor, &turn.cs[i], &turn.sn[i]);
      }
      fill_pair_angles(g, turn);
      for (int64_t h = 0; h < a.heads; ++h) {
        const int64_t at = outer * st[0] + inner * st[1] + h * st[2];
        if (fp8) {
          if constexpr (std::is_same_v<scalar_t, float>) {
            uint8_t* row = static_cast<uint8_t*>(a.cache) + at + begin * st[3];
            alignas(32) float stage[2 * kMaxRopePairs];
            for (int64_t e = 0; e < g.rotary_dim; ++e) stage[e] = kv_dequantize(a.format, row[e * st[3]], a.scale);
            rotate_row<float, float>(staged, stage, 1, stage, 1, turn);
            for (int64_t e = 0; e < g.rotary_dim; ++e) row[e * st[3]] = kv_quantize(a.format, stage[e], a.scale);
          }
        } else {
          scalar_t* row = static_cast<scalar_t*>(a.cache) + at;
          rotate_row<scalar_t, acc_t>(g, row, st[3], row, st[3], turn);
        }
      }
    }
  });
}

void rope_shift_kv_kernel(const RopeShiftKvArgs& a, c10::ScalarType dtype) {
  dispatch_floating(dtype, "posenc_rope_shift_kv_cpu", [&](auto* tag) {
    shift_rows<std::remove_pointer_t<decltype(tag)>>(a);
  });
}

}  // namespace
POSENC_ISA_NAMESPACE_END

POSENC_REGISTER_DISPATCH(rope_shift_kv_stub, &rope_shift_kv_kernel)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
