// Raw-pointer CPU kernel of apply_rope_cos_sin, compiled in a vector-ISA translation unit
// once per capability (POSENC_ISA_SOURCES in CMakeLists.txt; in the AVX2 build the
// rotation's fma is one instruction and the unit-stride loop vectorises). Tokens (batch,
// seq) are spread over threads with at::parallel_for; each token's table row (rotary_dim
// cos and sin values, already in the compute dtype) is read once for every head of q and
// k. Rows whose last dimension is contiguous take a loop over pairs the compiler
// vectorises; the rest an element loop with strides. The rotation is
// math::rope_rotate_pair_tables, as on CUDA, in float32 (float64 for float64); transpose
// (the backward) is a template argument, so the loops carry no branch. A call that writes
// kStreamBytes or more computes each contiguous, aligned row into an L1 buffer and streams
// it out (rope_rows.h): the same arithmetic, without the read of every output line that a
// plain store makes first.
#include "ops/rope_cos_sin/cpu/kernel.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#include "ops/common/cpu/rope_rows.h"  // kStreamBytes, row_can_stream, stream_row, stream_fence
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace {

// Rows of at most this many features are staged for streaming.
constexpr int64_t kStagedRow = 512;

// The rotated features [0, rot) of one row, x and y of unit stride, in acc_t.
template <typename acc_t, bool kTranspose>
inline void rotate_unit(const RopeCosSinArgs& a, const acc_t* x, acc_t* y, const acc_t* cs,
                        const acc_t* sn) {
  const int64_t half = a.rotary_dim / 2;
  if (!a.interleaved) {
    // Vectors (the compiler left the scalar loop scalar: y might alias x or the tables):
    // math::rope_rotate_pair_tables lane by lane, one product and one fma per output.
    using Vec = at::vec::Vectorized<acc_t>;
    int64_t p = 0;
    for (; p + Vec::size() <= half; p += Vec::size()) {
      const Vec x1 = Vec::loadu(x + p), x2 = Vec::loadu(x + half + p);
      const Vec c1 = Vec::loadu(cs + p), s1 = Vec::loadu(sn + p);
      const Vec c2 = Vec::loadu(cs + half + p), s2 = Vec::loadu(sn + half + p);
      if constexpr (kTranspose) {
        fma_vec(x1, c1, x2 * s2).store(y + p);
        fma_vec(x2, c2, (x1 * s1).neg()).store(y + half + p);
      } else {
        fma_vec(x1, c1, (x2 * s1).neg()).store(y + p);
        fma_vec(x2, c2, x1 * s2).store(y + half + p);
      }
    }
    for (; p < half; ++p) {
      math::rope_rotate_pair_tables<acc_t>(x[p], x[p + half], cs[p], sn[p], cs[p + half], sn[p + half],
                                           kTranspose, &y[p], &y[p + half]);
    }
  } else {
    for (int64_t p = 0; p < half; ++p) {
      math::rope_rotate_pair_tables<acc_t>(x[2 * p], x[2 * p + 1], cs[2 * p], sn[2 * p], cs[2 * p + 1],
                                           sn[2 * p + 1], kTranspose, &y[2 * p], &y[2 * p + 1]);
    }
  }
}

// The rotated features [0, rot) of a contiguous row of float32 or half precision, in float32
// registers (load_widened / store_narrowed: half precision widened and rounded on the way,
// no staging), math::rope_rotate_pair_tables lane by lane; the pairs past the last whole
// vector by the scalar form.
template <typename scalar_t, bool kTranspose, bool kStream>
inline void rotate_unit_wide(const RopeCosSinArgs& a, const scalar_t* x, scalar_t* y, const float* cs,
                             const float* sn) {
  using VecF = at::vec::Vectorized<float>;
  constexpr int64_t F = VecF::size(), W = 2 * F;  // W values per step
  const int64_t rot = a.rotary_dim, half = rot / 2;
  const auto tables = [](const float* t) { return std::pair<VecF, VecF>{VecF::loadu(t), VecF::loadu(t + F)}; };
  int64_t p = 0;
  if (!a.interleaved) {
    for (; p + W <= half; p += W) {
      const auto [x1a, x1b] = load_widened(x + p);
      const auto [x2a, x2b] = load_widened(x + half + p);
      const auto [c1a, c1b] = tables(cs + p);
      const auto [s1a, s1b] = tables(sn + p);
      const auto [c2a, c2b] = tables(cs + half + p);
      const auto [s2a, s2b] = tables(sn + half + p);
      if constexpr (kTranspose) {
        store_narrowed<kStream>(fma_vec(x1a, c1a, x2a * s2a), fma_vec(x1b, c1b, x2b * s2b), y + p);
        store_narrowed<kStream>(fma_vec(x2a, c2a, (x1a * s1a).neg()), fma_vec(x2b, c2b, (x1b * s1b).neg()),
                                y + half + p);
      } else {
        store_narrowed<kStream>(fma_vec(x1a, c1a, (x2a * s1a).neg()), fma_vec(x1b, c1b, (x2b * s1b).neg()),
                                y + p);
        store_narrowed<kStream>(fma_vec(x2a, c2a, x1a * s2a), fma_vec(x2b, c2b, x1b * s2b), y + half + p);
      }
    }
    for (; p < half; ++p) {
      float y1, y2;
      math::rope_rotate_pair_tables<float>(static_cast<float>(x[p]), static_cast<float>(x[p + half]), cs[p],
                                           sn[p], cs[p + half], sn[p + half], kTranspose, &y1, &y2);
      y[p] = static_cast<scalar_t>(y1);
      y[p + half] = static_cast<scalar_t>(y2);
    }
  } else {
    // Pairs as they lie (rope_rows.h: rotate_paired_vec); the tables are per feature already,
    // and the transpose reads each lane's partner's sine.
    const auto rotate = [](const VecF& xv, const VecF& c, const VecF& sv) {
      if constexpr (kTranspose) {
        return rotate_paired_vec<VecF, true>(xv, c, swap_pairs(sv));
      } else {
        return rotate_paired_vec<VecF>(xv, c, sv);
      }
    };
    for (; 2 * p + W <= rot; p += W / 2) {
      const int64_t e = 2 * p;
      const auto [xa, xb] = load_widened(x + e);
      const auto [ca, cb] = tables(cs + e);
      const auto [sa, sb] = tables(sn + e);
      store_narrowed<kStream>(rotate(xa, ca, sa), rotate(xb, cb, sb), y + e);
    }
    for (; p < half; ++p) {
      float y1, y2;
      math::rope_rotate_pair_tables<float>(static_cast<float>(x[2 * p]), static_cast<float>(x[2 * p + 1]),
                                           cs[2 * p], sn[2 * p], cs[2 * p + 1], sn[2 * p + 1], kTranspose, &y1,
                                           &y2);
      y[2 * p] = static_cast<scalar_t>(y1);
      y[2 * p + 1] = static_cast<scalar_t>(y2);
    }
  }
}

// Heads [h0, h1) of token (b, s) of one operand.
template <typename scalar_t, typename acc_t, bool kTranspose>
void rotate_rows(const RopeCosSinArgs& a, const RopeOperand& op, int64_t b, int64_t s, int64_t h0,
                 int64_t h1, const acc_t* cs, const acc_t* sn, bool stream) {
  const int64_t rot = a.rotary_dim, half = rot / 2;
  const auto* in = static_cast<const scalar_t*>(op.in);
  auto* out = static_cast<scalar_t*>(op.out);
  alignas(32) scalar_t staged[kStagedRow];
  for (int64_t h = h0; h < h1; ++h) {
    const scalar_t* x = in + b * op.in_stride[0] + s * op.in_stride[1] + h * op.in_stride[2];
    scalar_t* const row = out + b * op.out_stride[0] + s * op.out_stride[1] + h * op.out_stride[2];
    const int64_t xs = op.in_stride[3];
    if constexpr (!std::is_same_v<scalar_t, double>) {
      // Contiguous rows in float32 registers; a row that streams whole (every feature
      // rotated, aligned: rows_can_stream) streams straight from them.
      if (xs == 1 && op.out_stride[3] == 1 && rot == a.head_dim) {
        if (stream && rows_can_stream<scalar_t>(row, rot)) {
          rotate_unit_wide<scalar_t, kTranspose, true>(a, x, row, cs, sn);
        } else {
          rotate_unit_wide<scalar_t, kTranspose, false>(a, x, row, cs, sn);
        }
        continue;
      }
    }
    const bool nt = stream && op.out_stride[3] == 1 && a.head_dim <= kStagedRow &&
                    row_can_stream<scalar_t>(row, a.head_dim);
    scalar_t* y = nt ? staged : row;  // where the row is computed
    const int64_t ys = nt ? 1 : op.out_stride[3];
    if (xs == 1 && ys == 1) {
      // x and y may be the same row only in place, which this op never is (its outputs are
      // fresh tensors).
      if constexpr (std::is_same_v<scalar_t, double>) {
        rotate_unit<acc_t, kTranspose>(a, x, y, cs, sn);
      } else {
        rotate_unit_wide<scalar_t, kTranspose, false>(a, x, y, cs, sn);
      }
    } else {
      for (int64_t p = 0; p < half; ++p) {
        int64_t e1, e2;
        math::rope_pair_features(p, half, a.interleaved, &e1, &e2);
        acc_t y1, y2;
        math::rope_rotate_pair_tables<acc_t>(static_cast<acc_t>(x[e1 * xs]),
                                             static_cast<acc_t>(x[e2 * xs]), cs[e1], sn[e1], cs[e2],
                                             sn[e2], kTranspose, &y1, &y2);
        y[e1 * ys] = static_cast<scalar_t>(y1);
        y[e2 * ys] = static_cast<scalar_t>(y2);
      }
    }
    for (int64_t e = rot; e < a.head_dim; ++e) y[e * ys] = x[e * xs];  // partial rotary
    if (nt) stream_row(staged, row, a.head_dim);
  }
}

template <typename scalar_t, bool kTranspose>
void tokens(const RopeCosSinArgs& a) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto* cos = static_cast<const acc_t*>(a.cos);
  const auto* sin = static_cast<const acc_t*>(a.sin);
  const int64_t heads = a.q.heads + a.k.heads;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, heads * a.head_dim));
  const bool stream = a.batch * a.seq * heads * a.head_dim * static_cast<int64_t>(sizeof(scalar_t)) >=
                      kStreamBytes;
  // "bhsd" (Hugging Face's layout, heads further apart than tokens): token by token, every
  // head's row is a stream of its own that the prefetchers cannot follow; there a task walks
  // each head's rows over a block of tokens, in memory order (the same arithmetic per row).
  if (a.q.in_stride[1] < a.q.in_stride[2] && heads > 1 && a.seq > 1) {
    constexpr int64_t kBlock = 32;
    const int64_t blocks = (a.seq + kBlock - 1) / kBlock;
    at::parallel_for(0, a.batch * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / blocks, s0 = (unit % blocks) * kBlock, s1 = std::min(a.seq, s0 + kBlock);
        for (const RopeOperand* op : {&a.q, &a.k}) {
          for (int64_t h = 0; h < op->heads; ++h) {
            for (int64_t s = s0; s < s1; ++s) {
              prefetch_walk_ahead(static_cast<const scalar_t*>(op->in) + b * op->in_stride[0], op->in_stride[1],
                                  op->in_stride[2], h, s, s0, s1, a.head_dim, false);
              const int64_t row = b * a.table_batch_stride + s * a.rotary_dim;
              rotate_rows<scalar_t, acc_t, kTranspose>(a, *op, b, s, h, h + 1, cos + row, sin + row, stream);
            }
          }
        }
      }
      if (stream) stream_fence();
    });
    return;
  }
  at::parallel_for(0, a.batch * a.seq, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / a.seq, s = t % a.seq;
      const int64_t row = b * a.table_batch_stride + s * a.rotary_dim;
      rotate_rows<scalar_t, acc_t, kTranspose>(a, a.q, b, s, 0, a.q.heads, cos + row, sin + row, stream);
      if (a.k.heads > 0) {
        rotate_rows<scalar_t, acc_t, kTranspose>(a, a.k, b, s, 0, a.k.heads, cos + row, sin + row, stream);
      }
    }
    if (stream) stream_fence();  // before this thread's part is handed back
  });
}

}  // namespace

template <typename scalar_t>
void rope_cos_sin_tokens(const RopeCosSinArgs& a) {
  if (a.transpose) {
    tokens<scalar_t, true>(a);
  } else {
    tokens<scalar_t, false>(a);
  }
}

template void rope_cos_sin_tokens<float>(const RopeCosSinArgs&);
template void rope_cos_sin_tokens<double>(const RopeCosSinArgs&);
template void rope_cos_sin_tokens<c10::Half>(const RopeCosSinArgs&);
template void rope_cos_sin_tokens<c10::BFloat16>(const RopeCosSinArgs&);

namespace {
void rope_cos_sin_kernel(const RopeCosSinArgs& a, c10::ScalarType dtype) {
  dispatch_floating(dtype, "posenc_apply_rope_cos_sin_cpu", [&](auto* tag) {
    rope_cos_sin_tokens<std::remove_pointer_t<decltype(tag)>>(a);
  });
}
}  // namespace

POSENC_ISA_NAMESPACE_END

POSENC_REGISTER_DISPATCH(rope_cos_sin_stub, &rope_cos_sin_kernel)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
