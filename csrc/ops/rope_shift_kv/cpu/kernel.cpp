// CPU kernel of rope_shift_kv_. Items (batch row, row turned) are spread over threads
// (at::parallel_for); each item's turn is computed once (both ends' cos/sin by RoPE's own
// token_angles, combined by rope_shift_angle) and serves every head of its cache row, which
// is rotated in place by RoPE's row rotation (at::vec for contiguous rows). FP8 rows are
// dequantised into a float32 staging row, rotated, and quantised back with the same scale.
// One read and one write of each row turned; nothing else is touched.
#include "ops/rope_shift_kv/cpu/kernel.h"

#include <ATen/Parallel.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "ops/common/cpu/rope_rows.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace {

// cos and sin (token_angles' cs and sn) of every position in [first, first + count): rows
// of 2 * half values, cs then sn. rows null: no table (the angles are computed per item).
template <typename acc_t>
struct AngleTable {
  c10::DataPtr storage;  // from torch's CPU allocator, per call (seen by its memory accounting)
  const acc_t* rows = nullptr;
  int64_t first = 0;
};

// Both ends' angles as one table when they are one function of the position: one position
// axis, the same frequencies, attention factor and direction in both configurations (the
// common shift: same model, new positions), and the positions of both ends span fewer
// than 2 * items values (then each is computed once instead of twice per item: a context
// shift of n rows by d positions spans n + d; shared positions over a batch, fewer). The
// same token_angles per position, so the same bits.
template <typename acc_t>
AngleTable<acc_t> shared_angle_table(const RopeShiftKvArgs& a, int64_t items) {
  AngleTable<acc_t> t;
  const RopeArgs &from = a.from, &to = a.to;
  const int64_t half = to.rotary_dim / 2;
  if (items < 2 || from.n_axes != 1 || to.n_axes != 1 || from.rotary_dim != to.rotary_dim ||
      from.attention_factor != to.attention_factor || from.inverse != to.inverse ||
      !std::equal(from.inv_freq, from.inv_freq + half, to.inv_freq)) {
    return t;
  }
  // The positions' extremes, over the threads (min and max: the same whatever the split).
  using Span = std::pair<int64_t, int64_t>;
  const Span none{std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
  const Span span = at::parallel_reduce(
      0, items, 2048, none,
      [&](int64_t first, int64_t last, Span span) {
        int64_t p[math::kRopeMaxAxes];
        for (int64_t item = first; item < last; ++item) {
          const int64_t b = item / to.seq, j = item % to.seq;
          int64_t outer = 0, inner = 0;
          if (!shift_kv_row(a, b, j, &outer, &inner)) continue;
          for (const RopeArgs* end : {&from, &to}) {
            token_positions(*end, b, j, p);
            span.first = std::min(span.first, p[0]);
            span.second = std::max(span.second, p[0]);
          }
        }
        return span;
      },
      [](Span x, Span y) { return Span{std::min(x.first, y.first), std::max(x.second, y.second)}; });
  const int64_t lo = span.first, hi = span.second;
  // The span as unsigned: hi - lo may not fit int64_t.
  if (lo > hi || static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) >= static_cast<uint64_t>(2 * items - 1)) {
    return t;
  }
  const int64_t count = hi - lo + 1;
  t.storage = c10::GetCPUAllocator()->allocate(static_cast<size_t>(count * 2 * half) * sizeof(acc_t));
  acc_t* rows = static_cast<acc_t*>(t.storage.get());
  at::parallel_for(0, count, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, half)), [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t pos = lo + i;
      token_cos_sin<acc_t>(to, &pos, rows + i * 2 * half, rows + i * 2 * half + half);  // into the row
    }
  });
  t.rows = rows;
  t.first = lo;
  return t;
}

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
  const AngleTable<acc_t> table = shared_angle_table<acc_t>(a, items);
  // Rows that lie apart (rope_rows.h rows_have_gaps: MLA's latent cache, k_pe 64 of each
  // 576-feature row; a slice of a cache's heads): the rows of the item kPrefetchRowsAhead on
  // are prefetched for writing, for the reason of prefetch_row_ahead (the hardware
  // prefetchers do not follow them).
  const bool gaps = !fp8 && rows_have_gaps(st[2], st[3], g.head_dim);
  at::parallel_for(0, items, grain, [&](int64_t first, int64_t last) {
    TokenAngles<acc_t> old_angles, new_angles, turn;
    int64_t p_old[math::kRopeMaxAxes], p_new[math::kRopeMaxAxes];
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / g.seq, j = item % g.seq;
      int64_t outer = 0, inner = 0;
      if (gaps && item + kPrefetchRowsAhead < last &&
          shift_kv_row(a, (item + kPrefetchRowsAhead) / g.seq, (item + kPrefetchRowsAhead) % g.seq, &outer, &inner)) {
        for (int64_t h = 0; h < a.heads; ++h) {
          prefetch_row<scalar_t>(reinterpret_cast<std::uintptr_t>(static_cast<scalar_t*>(a.cache) + outer * st[0] +
                                                                  inner * st[1] + h * st[2]),
                                 g.head_dim, /*for_write=*/true);
        }
      }
      if (!shift_kv_row(a, b, j, &outer, &inner)) continue;  // slot -1
      token_positions(a.from, b, j, p_old);
      token_positions(a.to, b, j, p_new);
      const acc_t *cn = new_angles.cs, *sn = new_angles.sn, *co = old_angles.cs, *so = old_angles.sn;
      if (table.rows != nullptr) {  // both ends' angles from the call's table
        const acc_t* row_new = table.rows + (p_new[0] - table.first) * 2 * half;
        const acc_t* row_old = table.rows + (p_old[0] - table.first) * 2 * half;
        cn = row_new, sn = row_new + half, co = row_old, so = row_old + half;
      } else {
        token_angles<acc_t>(a.from, p_old, old_angles, false);
        token_angles<acc_t>(a.to, p_new, new_angles, false);
      }
      const acc_t factor = static_cast<acc_t>(a.factor);
      for (int64_t i = 0; i < half; ++i) {
        rope_shift_angle<acc_t>(cn[i], sn[i], co[i], so[i], factor, &turn.cs[i], &turn.sn[i]);
      }
      // Every pair keeps its angle (rope_shift_keeps; looked at only where the positions of
      // both ends agree on every axis, the one place it can hold): the row stays as it is.
      if (std::equal(p_old, p_old + g.n_axes, p_new)) {
        bool keeps = true;
        for (int64_t i = 0; i < half && keeps; ++i) {
          keeps = rope_shift_keeps<acc_t>(p_old[g.pair_axis[i]], p_new[g.pair_axis[i]], cn[i], sn[i], co[i], so[i],
                                          factor);
        }
        if (keeps) continue;
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
