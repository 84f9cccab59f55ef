// The forward rows of qk_norm_rope's CPU kernel (cpu/kernel.cpp), shared with the kernel
// that normalises on the way into a KV cache (rope_append_kv's, with q_weight): sums of
// squares in 8 lanes added in a fixed order (vectorised, the scalar loop's roundings: the
// same bits at every ISA level), each token's inverse RMS per head or per projection, and
// each row normalised, weighted and rotated (posenc/math/qk_norm.h, posenc/math/rope.h),
// rounded once. Only for the vector-ISA translation units: every function lives in the ISA
// namespace (posenc/math/host_device.h).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "ops/common/cpu/rope_rows.h"  // TokenAngles, rotate_vec
#include "ops/qk_norm_rope/cpu/kernel.h"  // QkNormRopeArgs
#include "posenc/math/qk_norm.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace qk_norm_rows {

constexpr int kLanes = 8;

template <typename acc_t>
inline acc_t lanes_sum(const acc_t (&part)[kLanes]) {
  acc_t s = 0;
  for (int i = 0; i < kLanes; ++i) s += part[i];
  return s;
}

template <bool kC>
inline int64_t at_(int64_t e, int64_t stride) {
  return kC ? e : e * stride;
}

// add_squares past its vector part: features e.. n-1, in groups of kLanes, then one by one.
template <typename scalar_t, typename acc_t, bool kC>
inline void add_squares_tail(const scalar_t* in, int64_t si, int64_t e, int64_t n, acc_t (&part)[kLanes]) {
  for (; e + kLanes <= n; e += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const acc_t x = static_cast<acc_t>(in[at_<kC>(e + l, si)]);
      part[l] += x * x;
    }
  }
  for (; e < n; ++e) {
    const acc_t x = static_cast<acc_t>(in[at_<kC>(e, si)]);
    part[0] += x * x;
  }
}

// Sum of squares of n features, into the lanes.
template <typename scalar_t, typename acc_t, bool kC>
inline void add_squares(const scalar_t* in, int64_t si, int64_t n, acc_t (&part)[kLanes]) {
  int64_t e = 0;
#if defined(CPU_CAPABILITY_AVX2)
  // The lanes as one vector: lane l still sums elements l, l + 8, ... in order, each
  // step part[l] + x * x rounded twice as the scalar loop's (no contraction: CMakeLists.txt):
  // the same bits (and half precision widened by vector conversions).
  if constexpr (kC && std::is_same_v<acc_t, float>) {
    using VecF = Vectorized<float>;
    static_assert(VecF::size() == kLanes, "one AVX2 float vector of lanes");
    VecF acc = VecF::loadu(part);
    if constexpr (std::is_same_v<scalar_t, float>) {
      for (; e + kLanes <= n; e += kLanes) {
        const VecF x = VecF::loadu(in + e);
        acc = acc + x * x;
      }
    } else {
      using VecH = Vectorized<scalar_t>;
      for (; e + 2 * kLanes <= n; e += 2 * kLanes) {
        auto [xa, xb] = at::vec::convert_to_float<scalar_t>(VecH::loadu(in + e));
        acc = acc + xa * xa;
        acc = acc + xb * xb;
      }
    }
    acc.store(part);
  }
#endif
  add_squares_tail<scalar_t, acc_t, kC>(in, si, e, n, part);
}

#if defined(CPU_CAPABILITY_AVX2)
// add_squares of N contiguous rows at once, float32 arithmetic: each row's lanes summed in
// add_squares's order with add_squares's roundings (the same bits), the N chains of
// dependent additions interleaved so that their latencies overlap (one row's chain alone
// is latency-bound: perf showed the first pass over each head carrying the call).
template <typename scalar_t, int N>
inline void add_squares_rows(const scalar_t* const (&in)[N], int64_t n, float (&part)[N][kLanes]) {
  using VecF = Vectorized<float>;
  static_assert(VecF::size() == kLanes, "one AVX2 float vector of lanes");
  VecF acc[N];
  for (int i = 0; i < N; ++i) acc[i] = VecF::loadu(part[i]);
  int64_t e = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (; e + kLanes <= n; e += kLanes) {
      for (int i = 0; i < N; ++i) {
        const VecF x = VecF::loadu(in[i] + e);
        acc[i] = acc[i] + x * x;
      }
    }
  } else {
    using VecH = Vectorized<scalar_t>;
    for (; e + 2 * kLanes <= n; e += 2 * kLanes) {
      for (int i = 0; i < N; ++i) {
        auto [xa, xb] = at::vec::convert_to_float<scalar_t>(VecH::loadu(in[i] + e));
        acc[i] = acc[i] + xa * xa;
        acc[i] = acc[i] + xb * xb;
      }
    }
  }
  for (int i = 0; i < N; ++i) {
    acc[i].store(part[i]);
    add_squares_tail<scalar_t, float, true>(in[i], 1, e, n, part[i]);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// math::qk_norm_inv_rms(lanes_sum(part[i]), n, eps) of four rows at once, one row per lane:
// lanes_sum's additions in its order and the same correctly rounded divisions and square
// root (the same bits), the four latency chains overlapped instead of one after another.
inline void inv_rms4(const float (&part)[4][kLanes], int64_t n, float eps, float (&r)[4]) {
  __m128 sum = _mm_setzero_ps();
  for (int l = 0; l < kLanes; ++l) sum = _mm_add_ps(sum, _mm_setr_ps(part[0][l], part[1][l], part[2][l], part[3][l]));
  const __m128 mean_eps = _mm_add_ps(_mm_div_ps(sum, _mm_set1_ps(static_cast<float>(n))), _mm_set1_ps(eps));
  _mm_storeu_ps(r, _mm_div_ps(_mm_set1_ps(1.0f), _mm_sqrt_ps(mean_eps)));
}
#endif

template <typename scalar_t>
const scalar_t* row_in(const RopeOperand& op, int64_t b, int64_t s, int64_t h) {
  return static_cast<const scalar_t*>(op.in) + b * op.in_stride[0] + s * op.in_stride[1] +
         h * op.in_stride[2];
}
template <typename scalar_t>
scalar_t* row_out(const RopeOperand& op, int64_t b, int64_t s, int64_t h) {
  return static_cast<scalar_t*>(op.out) + b * op.out_stride[0] + s * op.out_stride[1] +
         h * op.out_stride[2];
}

template <typename scalar_t, typename acc_t, bool kC>
acc_t inv_rms_of(const QkNormRopeArgs& a, const RopeOperand& op, int64_t b, int64_t s,
                 int64_t h_begin, int64_t h_end) {
  const int64_t D = a.rope.head_dim;
  acc_t part[kLanes] = {};
  for (int64_t h = h_begin; h < h_end; ++h) {
    add_squares<scalar_t, acc_t, kC>(row_in<scalar_t>(op, b, s, h), op.in_stride[3], D, part);
  }
  return math::qk_norm_inv_rms<acc_t>(lanes_sum(part), (h_end - h_begin) * D,
                                      static_cast<acc_t>(a.eps));
}

// The first pairs of a contiguous row in half-split ("rotate_half") layout, in vectors:
// qk_norm_apply's (x * r) * w and math::rope_rotate_pair lane by lane (the same roundings;
// half precision widened and narrowed with vector conversions). Returns the pairs done.
// kStream: streaming stores (rope_rows.h store_vec; the caller checked the alignment).
// w_lanes (bfloat16, AVX2; else unused): the rotary part's weights in the lane order of
// widen_bf16_lanes (rope_rows.h lane_order_halves), with which the row is widened and narrowed in lane
// order and the angles read from cs2 / sn2 (rope_rows.h rotate_row_vec_reduced's way: two
// unpacks a load, no lane permute a store).
template <typename scalar_t, typename acc_t, bool kStream = false>
int64_t forward_pairs_vec(const scalar_t* in, scalar_t* out, const acc_t* w, acc_t r,
                          const TokenAngles<acc_t>& t, int64_t half, const acc_t* w_lanes = nullptr) {
  using VecA = Vectorized<acc_t>;
  const VecA vr(r);
  int64_t p = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (w_lanes != nullptr) {
      // (x * r) * w and rotate_vec's operations, lane by lane as below: the same bits.
      constexpr int64_t F = 8;
      const __m256 rv = _mm256_set1_ps(r);
      for (; p + 2 * F <= half; p += 2 * F) {
        __m256 x1a, x1b, x2a, x2b;
        widen_bf16_lanes(in + p, x1a, x1b);
        widen_bf16_lanes(in + half + p, x2a, x2b);
        x1a = _mm256_mul_ps(_mm256_mul_ps(x1a, rv), _mm256_loadu_ps(w_lanes + p));
        x1b = _mm256_mul_ps(_mm256_mul_ps(x1b, rv), _mm256_loadu_ps(w_lanes + p + F));
        x2a = _mm256_mul_ps(_mm256_mul_ps(x2a, rv), _mm256_loadu_ps(w_lanes + half + p));
        x2b = _mm256_mul_ps(_mm256_mul_ps(x2b, rv), _mm256_loadu_ps(w_lanes + half + p + F));
        VecA y1a, y2a, y1b, y2b;
        rotate_vec(VecA(x1a), VecA(x2a), VecA::loadu(t.cs2 + p), VecA::loadu(t.sn2 + p), y1a, y2a);
        rotate_vec(VecA(x1b), VecA(x2b), VecA::loadu(t.cs2 + p + F), VecA::loadu(t.sn2 + p + F), y1b, y2b);
        store_vec<kStream>(Vectorized<scalar_t>(narrow_bf16_lanes(y1a, y1b)), out + p);
        store_vec<kStream>(Vectorized<scalar_t>(narrow_bf16_lanes(y2a, y2b)), out + half + p);
      }
      return p;
    }
  }
#endif
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    for (; p + VecA::size() <= half; p += VecA::size()) {
      const VecA x1 = VecA::loadu(in + p) * vr * VecA::loadu(w + p);
      const VecA x2 = VecA::loadu(in + half + p) * vr * VecA::loadu(w + half + p);
      VecA y1, y2;
      rotate_vec(x1, x2, VecA::loadu(t.cs + p), VecA::loadu(t.sn + p), y1, y2);
      store_vec<kStream>(y1, out + p);
      store_vec<kStream>(y2, out + half + p);
    }
  } else {
    using VecH = Vectorized<scalar_t>;
    constexpr int64_t F = VecA::size();
    for (; p + VecH::size() <= half; p += VecH::size()) {
      auto [x1a, x1b] = at::vec::convert_to_float<scalar_t>(VecH::loadu(in + p));
      auto [x2a, x2b] = at::vec::convert_to_float<scalar_t>(VecH::loadu(in + half + p));
      x1a = x1a * vr * VecA::loadu(w + p);
      x1b = x1b * vr * VecA::loadu(w + p + F);
      x2a = x2a * vr * VecA::loadu(w + half + p);
      x2b = x2b * vr * VecA::loadu(w + half + p + F);
      VecA y1a, y2a, y1b, y2b;
      rotate_vec(x1a, x2a, VecA::loadu(t.cs + p), VecA::loadu(t.sn + p), y1a, y2a);
      rotate_vec(x1b, x2b, VecA::loadu(t.cs + p + F), VecA::loadu(t.sn + p + F), y1b, y2b);
      store_vec<kStream>(at::vec::convert_from_float<scalar_t>(y1a, y1b), out + p);
      store_vec<kStream>(at::vec::convert_from_float<scalar_t>(y2a, y2b), out + half + p);
    }
  }
  return p;
}

// Software prefetch, for reading, of the n rows of d features kPrefetchRowsAhead heads on
// from head h of token (b, s) (rope_rows.h prefetch_row_ahead). The first pass over a group
// of heads otherwise waits for each line in turn.
template <typename scalar_t>
inline void prefetch_rows(const RopeOperand& op, int64_t b, int64_t s, int64_t h, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    prefetch_row_ahead(row_in<scalar_t>(op, b, s, h + i), op.in_stride[2], d, /*for_write=*/false);
  }
}

// Forward of one head row: normalise, weight (w: the row's effective weights), rotate.
// `stream` (the call writes kStreamBytes or more): streaming stores where the row is all
// rotary features, contiguous, written elsewhere than read and aligned (rope_rows.h
// row_streams, rows_can_stream): a plain store first reads the line it fills.
template <typename scalar_t, typename acc_t, bool kC>
void forward_row(const QkNormRopeArgs& a, const scalar_t* in, int64_t si, scalar_t* out,
                 int64_t so, const acc_t* w, acc_t r, const TokenAngles<acc_t>& t, bool stream = false,
                 const acc_t* w_lanes = nullptr) {
  const int64_t half = a.rope.rotary_dim / 2, D = a.rope.head_dim;
  const int64_t o = math::rope_rotary_begin(a.rope.settings);  // the rotary part's start
  if (!a.rope.interleaved) {
    int64_t first = 0;
    if constexpr (kC) {
      if (2 * half == D && row_streams(stream, in, out) && rows_can_stream<scalar_t>(out, 2 * half)) {
        first = forward_pairs_vec<scalar_t, acc_t, true>(in + o, out + o, w + o, r, t, half, w_lanes);
      } else {
        first = forward_pairs_vec<scalar_t, acc_t>(in + o, out + o, w + o, r, t, half, w_lanes);
      }
    }
    for (int64_t p = first; p < half; ++p) {
      const acc_t x1 = math::qk_norm_apply(static_cast<acc_t>(in[at_<kC>(o + p, si)]), r, w[o + p]);
      const acc_t x2 =
          math::qk_norm_apply(static_cast<acc_t>(in[at_<kC>(o + p + half, si)]), r, w[o + p + half]);
      acc_t y1, y2;
      math::rope_rotate_pair(x1, x2, t.cs[p], t.sn[p], &y1, &y2);
      out[at_<kC>(o + p, so)] = static_cast<scalar_t>(y1);
      out[at_<kC>(o + p + half, so)] = static_cast<scalar_t>(y2);
    }
  } else {
    for (int64_t p = 0; p < half; ++p) {
      const acc_t x1 = math::qk_norm_apply(static_cast<acc_t>(in[at_<kC>(o + 2 * p, si)]), r, w[o + 2 * p]);
      const acc_t x2 =
          math::qk_norm_apply(static_cast<acc_t>(in[at_<kC>(o + 2 * p + 1, si)]), r, w[o + 2 * p + 1]);
      acc_t y1, y2;
      math::rope_rotate_pair(x1, x2, t.cs[p], t.sn[p], &y1, &y2);
      out[at_<kC>(o + 2 * p, so)] = static_cast<scalar_t>(y1);
      out[at_<kC>(o + 2 * p + 1, so)] = static_cast<scalar_t>(y2);
    }
  }
  for (int64_t j = 0; j < D - 2 * half; ++j) {  // outside the rotary part: normalised only
    const int64_t e = math::rope_pass_feature(j, o, 2 * half);
    out[at_<kC>(e, so)] =
        static_cast<scalar_t>(math::qk_norm_apply(static_cast<acc_t>(in[at_<kC>(e, si)]), r, w[e]));
  }
}

template <typename scalar_t>
void nan_rows(const QkNormRopeArgs& a, const RopeOperand& op, int64_t b, int64_t s) {
  for (int64_t h = 0; h < op.heads; ++h) {
    scalar_t* out = row_out<scalar_t>(op, b, s, h);
    for (int64_t e = 0; e < a.rope.head_dim; ++e) {
      out[e * op.out_stride[3]] = std::numeric_limits<scalar_t>::quiet_NaN();
    }
  }
}

// Every head row of `op` at token (b, s); `stream` as forward_row's (the caller fences:
// stream_fence).
#if defined(CPU_CAPABILITY_AVX2) && (defined(__GNUC__) || defined(__clang__))
POSENC_AVX512_WARNINGS_BEGIN
// forward_operand's group of 4 half-precision heads (norm "head") on CPUs with AVX-512
// (compiled by target attribute, called where cpu_has_avx512()), for rows that are all
// rotary halves of whole 16-lane vectors: the squares and the rows 16 lanes wide, each value
// rounded as add_squares_rows and forward_pairs_vec round it, the sums in their 8-lane order
// (add8), so the same bits (test_cpu_capability.py compares the levels).
template <typename scalar_t>
POSENC_AVX512_TARGET void forward_group_avx512(const QkNormRopeArgs& a, const scalar_t* const (&rows)[4],
                                               scalar_t* const (&outs)[4], const float* w,
                                               const TokenAngles<float>& t, bool stream) {
  const int64_t D = a.rope.head_dim, half = D / 2;
  __m256 acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t e = 0; e < D; e += 16) {
    for (int i = 0; i < 4; ++i) {
      const __m512 x = load16(rows[i] + e);
      acc[i] = add8(acc[i], _mm512_mul_ps(x, x));
    }
  }
  alignas(32) float part[4][kLanes];
  for (int i = 0; i < 4; ++i) _mm256_store_ps(part[i], acc[i]);
  alignas(16) float r[4];
  inv_rms4(part, D, static_cast<float>(a.eps), r);
  for (int i = 0; i < 4; ++i) {
    const __m512 rv = _mm512_set1_ps(r[i]);
    const bool streamed = row_streams(stream, rows[i], outs[i]) && rows_can_stream<scalar_t>(outs[i], D);
    for (int64_t p = 0; p < half; p += 16) {
      // (x * r) * w, then rotate_vec: x1 c - x2 s and x2 c + x1 s, one product and one fma each.
      const __m512 x1 = _mm512_mul_ps(_mm512_mul_ps(load16(rows[i] + p), rv), _mm512_loadu_ps(w + p));
      const __m512 x2 = _mm512_mul_ps(_mm512_mul_ps(load16(rows[i] + half + p), rv), _mm512_loadu_ps(w + half + p));
      const __m512 c = _mm512_loadu_ps(t.cs + p), sn = _mm512_loadu_ps(t.sn + p);
      const __m256i y1 = narrow16<scalar_t>(_mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, sn)));
      const __m256i y2 = narrow16<scalar_t>(_mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, sn)));
      auto* o1 = reinterpret_cast<__m256i*>(outs[i] + p);
      auto* o2 = reinterpret_cast<__m256i*>(outs[i] + half + p);
      if (streamed) {
        _mm256_stream_si256(o1, y1);
        _mm256_stream_si256(o2, y2);
      } else {
        _mm256_storeu_si256(o1, y1);
        _mm256_storeu_si256(o2, y2);
      }
    }
  }
}
POSENC_AVX512_WARNINGS_END
#endif

template <typename scalar_t, typename acc_t, bool kC>
void forward_operand(const QkNormRopeArgs& a, const RopeOperand& op, const acc_t* w, int64_t b,
                     int64_t s, const TokenAngles<acc_t>& t, bool stream = false) {
  const int64_t D = a.rope.head_dim;
  const bool hidden = a.norm == QkNorm::kHidden;
  const acc_t r_all = hidden ? inv_rms_of<scalar_t, acc_t, kC>(a, op, b, s, 0, op.heads) : acc_t(0);
  int64_t h = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kC && std::is_same_v<acc_t, float> && !std::is_same_v<scalar_t, float>) {
    // Norm "head", half precision: the inverse RMS of kGroup heads at once
    // (add_squares_rows: their chains interleaved; the next group's lines prefetched), then
    // their rows, re-read from L1. (float32 stays head by head: the same grouping measured
    // 3.2 -> 3.5 ms there, a memory-bound pass that the hardware prefetchers already follow.)
    constexpr int kGroup = 4;
    // bfloat16 rows of split halves: the weights once in lane order for forward_pairs_vec.
    alignas(32) float w_lanes[2 * kMaxRopePairs];
    const float* wl = nullptr;
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (!hidden && !a.rope.interleaved && op.heads >= kGroup) {
        lane_order_halves(w + math::rope_rotary_begin(a.rope.settings), a.rope.rotary_dim / 2, w_lanes);
        wl = w_lanes;
      }
    }
#if defined(__GNUC__) || defined(__clang__)
    // forward_group_avx512's rows: all rotary halves, of whole 16-lane vectors.
    const bool wide = cpu_has_avx512() && !hidden && !a.rope.interleaved && a.rope.rotary_dim == D &&
                      math::rope_rotary_begin(a.rope.settings) == 0 && D % 32 == 0;
#endif
    for (; !hidden && h + kGroup <= op.heads; h += kGroup) {
      const scalar_t* rows[kGroup];
      for (int i = 0; i < kGroup; ++i) rows[i] = row_in<scalar_t>(op, b, s, h + i);
      prefetch_rows<scalar_t>(op, b, s, h, kGroup, D);
#if defined(__GNUC__) || defined(__clang__)
      if (wide) {
        scalar_t* outs[kGroup];
        for (int i = 0; i < kGroup; ++i) outs[i] = row_out<scalar_t>(op, b, s, h + i);
        forward_group_avx512<scalar_t>(a, rows, outs, w, t, stream);
        continue;
      }
#endif
      alignas(32) float part[kGroup][kLanes];
      for (int i = 0; i < kGroup; ++i) _mm256_store_ps(part[i], _mm256_setzero_ps());
      add_squares_rows<scalar_t, kGroup>(rows, D, part);
      alignas(16) float r[kGroup];
      inv_rms4(part, D, static_cast<float>(a.eps), r);
      for (int i = 0; i < kGroup; ++i) {
        forward_row<scalar_t, acc_t, kC>(a, rows[i], 1, row_out<scalar_t>(op, b, s, h + i), 1, w, r[i], t, stream,
                                         wl);
      }
    }
  }
#endif
  for (; h < op.heads; ++h) {
    const acc_t r = hidden ? r_all : inv_rms_of<scalar_t, acc_t, kC>(a, op, b, s, h, h + 1);
    forward_row<scalar_t, acc_t, kC>(a, row_in<scalar_t>(op, b, s, h), op.in_stride[3],
                                     row_out<scalar_t>(op, b, s, h), op.out_stride[3],
                                     w + (hidden ? h * D : 0), r, t, stream);
  }
}

}  // namespace qk_norm_rows
POSENC_ISA_NAMESPACE_END
}  // namespace cpu
}  // namespace ops
}  // namespace posenc
