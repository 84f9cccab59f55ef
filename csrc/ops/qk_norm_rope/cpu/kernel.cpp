// CPU kernel of qk_norm_rope: one pass per token over q and k, forward and backward.
//
// Tokens are spread over threads with at::parallel_for. Per token, the cos/sin of its pairs
// are computed once (rope_rows.h, the RoPE kernel's), then for each of q and k: the inverse
// RMS of each head (norm "head") or of the token's whole projection ("hidden"), and each
// pair normalised, weighted and rotated (posenc/math/qk_norm.h, posenc/math/rope.h), in
// float32 (float64 for float64) and rounded once. The backward turns the incoming gradient
// back pair by pair, sums mean(g * xhat) of the vector and the weight gradient's terms, then
// writes dx in a second pass over the (cached) row. Sums run in 8 independent lanes added in
// a fixed order, so that the loops vectorise and the result does not depend on threads.
#include "ops/qk_norm_rope/cpu/kernel.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "ops/common/cpu/rope_rows.h"  // TokenAngles, token_positions, token_angles
#include "ops/common/cpu/qk_norm_rows.h"  // the forward rows, add_squares, lanes
#include "posenc/math/qk_norm.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace {

using namespace qk_norm_rows;

// Rows of at most this many features are staged on the stack in the backward (norm "head").
constexpr int64_t kStagedRow = 256;

// Backward, pass A over one head row: the unrotated gradient gu of every feature; adds
// sum(gu * w * xhat) to the lanes and gu * xhat to the weight-gradient row dw.
template <typename scalar_t, typename acc_t, bool kC, bool kIl>
void backward_row_sums(const QkNormRopeArgs& a, const scalar_t* x, int64_t sx, const scalar_t* g,
                       int64_t sg, const acc_t* w, acc_t r, const TokenAngles<acc_t>& t,
                       acc_t* dw, acc_t (&part)[kLanes]) {
  const int64_t half = a.rope.rotary_dim / 2, D = a.rope.head_dim;
  const int64_t o = math::rope_rotary_begin(a.rope.settings);
  int64_t p = 0;
  auto pair = [&](int64_t p, int l) {
    const int64_t e1 = o + (kIl ? 2 * p : p), e2 = o + (kIl ? 2 * p + 1 : p + half);
    acc_t gu1, gu2;
    math::rope_rotate_pair(static_cast<acc_t>(g[at_<kC>(e1, sg)]), static_cast<acc_t>(g[at_<kC>(e2, sg)]),
                           t.cs[p], t.sn[p], &gu1, &gu2);
    const acc_t xh1 = static_cast<acc_t>(x[at_<kC>(e1, sx)]) * r;
    const acc_t xh2 = static_cast<acc_t>(x[at_<kC>(e2, sx)]) * r;
    dw[e1] += gu1 * xh1;
    dw[e2] += gu2 * xh2;
    part[l] += gu1 * w[e1] * xh1 + gu2 * w[e2] * xh2;
  };
  for (; p + kLanes <= half; p += kLanes) {
    for (int l = 0; l < kLanes; ++l) pair(p + l, l);
  }
  for (; p < half; ++p) pair(p, 0);
  for (int64_t j = 0; j < D - 2 * half; ++j) {
    const int64_t e = math::rope_pass_feature(j, o, 2 * half);
    const acc_t gu = static_cast<acc_t>(g[at_<kC>(e, sg)]);
    const acc_t xh = static_cast<acc_t>(x[at_<kC>(e, sx)]) * r;
    dw[e] += gu * xh;
    part[1] += gu * w[e] * xh;
  }
}

// Backward, pass B over one head row: dx from gu (turned back again), xhat and mean(g xhat).
template <typename scalar_t, typename acc_t, bool kC, bool kIl>
void backward_row_dx(const QkNormRopeArgs& a, const scalar_t* x, int64_t sx, const scalar_t* g,
                     int64_t sg, scalar_t* dx, int64_t sd, const acc_t* w, acc_t r, acc_t mean_gx,
                     const TokenAngles<acc_t>& t) {
  const int64_t half = a.rope.rotary_dim / 2, D = a.rope.head_dim;
  const int64_t o = math::rope_rotary_begin(a.rope.settings);
  for (int64_t p = 0; p < half; ++p) {
    const int64_t e1 = o + (kIl ? 2 * p : p), e2 = o + (kIl ? 2 * p + 1 : p + half);
    acc_t gu1, gu2;
    math::rope_rotate_pair(static_cast<acc_t>(g[at_<kC>(e1, sg)]), static_cast<acc_t>(g[at_<kC>(e2, sg)]),
                           t.cs[p], t.sn[p], &gu1, &gu2);
    const acc_t xh1 = static_cast<acc_t>(x[at_<kC>(e1, sx)]) * r;
    const acc_t xh2 = static_cast<acc_t>(x[at_<kC>(e2, sx)]) * r;
    dx[at_<kC>(e1, sd)] = static_cast<scalar_t>(math::qk_norm_grad_input(gu1, w[e1], xh1, mean_gx, r));
    dx[at_<kC>(e2, sd)] = static_cast<scalar_t>(math::qk_norm_grad_input(gu2, w[e2], xh2, mean_gx, r));
  }
  for (int64_t j = 0; j < D - 2 * half; ++j) {
    const int64_t e = math::rope_pass_feature(j, o, 2 * half);
    const acc_t gu = static_cast<acc_t>(g[at_<kC>(e, sg)]);
    const acc_t xh = static_cast<acc_t>(x[at_<kC>(e, sx)]) * r;
    dx[at_<kC>(e, sd)] = static_cast<scalar_t>(math::qk_norm_grad_input(gu, w[e], xh, mean_gx, r));
  }
}

// A contiguous row of n values widened to float32 (exact), with vector conversions for half
// precision.
template <typename scalar_t>
inline void widen_row(const scalar_t* x, float* out, int64_t n) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<scalar_t, float>) {
    using VecH = Vectorized<scalar_t>;
    for (; i + VecH::size() <= n; i += VecH::size()) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(VecH::loadu(x + i));
      lo.store(out + i);
      hi.store(out + i + Vectorized<float>::size());
    }
  }
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

#if defined(CPU_CAPABILITY_AVX2)
// 8 contiguous values widened to float32 (exact).
template <typename scalar_t>
inline Vectorized<float> load_float8(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vectorized<float>::loadu(p);
  } else {
    __m256 o;
    at::vec::cvt_to_fp32<scalar_t>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), o);
    return o;
  }
}

// The backward of kG head rows of one token (norm "head", contiguous half-split rows of at
// most kStagedRow features, float32 arithmetic), each operation rounded as the scalar loop
// of backward_operand rounds it (no contraction: CMakeLists.txt), so the same bits:
//  - x is read from its row (widened on the fly: no staged copy), the gradient turned back
//    once into gs;
//  - the kG sums of squares and the kG sums of gu * w * xhat run as interleaved chains
//    (one head's chain alone is latency-bound), the weight gradient's row gets the kG
//    heads' terms in head order in registers (one load and store of dw per kG heads);
//  - dx is narrowed and stored straight from the vectors (was a staged row and a copy:
//    memmove, carrying the stores' misses, was a quarter of the float32 backward in perf).
//  - with `stream` (the call writes kStreamBytes or more), rows that start 32-byte aligned
//    and are whole vectors store dx with streaming stores (rope_rows.h store_vec: a plain
//    store first reads the line it fills; the caller fences).
template <typename scalar_t, int kG>
void backward_heads_vec(const QkNormRopeArgs& a, const scalar_t* const (&x)[kG],
                        const scalar_t* const (&g)[kG], scalar_t* const (&dx)[kG], const float* w,
                        float* dw, const TokenAngles<float>& t, bool stream) {
  using Vec = Vectorized<float>;
  constexpr int64_t W = Vec::size();
  const int64_t D = a.rope.head_dim, half = a.rope.rotary_dim / 2;
  const int64_t o = math::rope_rotary_begin(a.rope.settings);
  const float eps = static_cast<float>(a.eps);
  alignas(64) float gs[kG][kStagedRow];
  float r[kG];
  // Rows that are all rotary halves (the common case): the gradient's turn-back and the
  // squares of x in one pass per row, so that g's and x's lines are asked for together (two
  // passes, g's then x's, waited for each stream in turn: perf's hot spots were the first
  // loads of each); the squares are summed after it in the same order as below (same bits).
  if (o == 0 && 2 * half == D && half % W == 0) {
    alignas(64) float sq[kG][kStagedRow];
    for (int i = 0; i < kG; ++i) {
      for (int64_t p = 0; p < half; p += W) {
        const Vec x1 = load_float8(x[i] + p), x2 = load_float8(x[i] + half + p);
        Vec gu1, gu2;
        rotate_vec(load_float8(g[i] + p), load_float8(g[i] + half + p), Vec::loadu(t.cs + p),
                   Vec::loadu(t.sn + p), gu1, gu2);
        gu1.store(gs[i] + p);
        gu2.store(gs[i] + half + p);
        (x1 * x1).store(sq[i] + p);
        (x2 * x2).store(sq[i] + half + p);
      }
    }
    Vec acc[kG];
    for (int i = 0; i < kG; ++i) acc[i] = Vec(0.0f);
    for (int64_t e = 0; e < D; e += W) {
      for (int i = 0; i < kG; ++i) acc[i] = acc[i] + Vec::loadu(sq[i] + e);
    }
    for (int i = 0; i < kG; ++i) {
      float lanes[kLanes];
      acc[i].store(lanes);
      r[i] = math::qk_norm_inv_rms<float>(lanes_sum(lanes), D, eps);
    }
  } else {
    // The gradient turned back, read from its row once (the features outside the rotary part
    // copied as they are; was a staged copy of the whole row first: memmove, 20-27% in perf).
    for (int i = 0; i < kG; ++i) {
      for (int64_t e = 0; e < D; ++e) {
        if (e == o) e += 2 * half;  // the rotary part: below
        if (e < D) gs[i][e] = static_cast<float>(g[i][e]);
      }
      int64_t p = 0;
      for (; p + W <= half; p += W) {
        Vec gu1, gu2;
        rotate_vec(load_float8(g[i] + o + p), load_float8(g[i] + o + half + p), Vec::loadu(t.cs + p),
                   Vec::loadu(t.sn + p), gu1, gu2);
        gu1.store(gs[i] + o + p);
        gu2.store(gs[i] + o + half + p);
      }
      for (; p < half; ++p) {
        float gu1, gu2;
        math::rope_rotate_pair(static_cast<float>(g[i][o + p]), static_cast<float>(g[i][o + p + half]), t.cs[p],
                               t.sn[p], &gu1, &gu2);
        gs[i][o + p] = gu1;
        gs[i][o + p + half] = gu2;
      }
    }
    // The inverse RMS of each row.
    {
      Vec acc[kG];
      for (int i = 0; i < kG; ++i) acc[i] = Vec(0.0f);
      int64_t e = 0;
      for (; e + W <= D; e += W) {
        for (int i = 0; i < kG; ++i) {
          const Vec xv = load_float8(x[i] + e);
          acc[i] = acc[i] + xv * xv;
        }
      }
      for (int i = 0; i < kG; ++i) {
        float sq[kLanes];
        acc[i].store(sq);
        for (int64_t j = e; j < D; ++j) {
          const float xv = static_cast<float>(x[i][j]);
          sq[0] += xv * xv;
        }
        r[i] = math::qk_norm_inv_rms<float>(lanes_sum(sq), D, eps);
      }
    }
  }
  // The weight gradient's terms and mean(gu * w * xhat) of each row.
  float mean[kG];
  {
    Vec rv[kG], part[kG];
    for (int i = 0; i < kG; ++i) {
      rv[i] = Vec(r[i]);
      part[i] = Vec(0.0f);
    }
    int64_t e = 0;
    for (; e + W <= D; e += W) {
      Vec d = Vec::loadu(dw + e);
      const Vec wv = Vec::loadu(w + e);
      for (int i = 0; i < kG; ++i) {
        const Vec gv = Vec::loadu(gs[i] + e), xh = load_float8(x[i] + e) * rv[i];
        d = d + gv * xh;
        part[i] = part[i] + gv * wv * xh;
      }
      d.store(dw + e);
    }
    for (int i = 0; i < kG; ++i) {
      float lanes[kLanes];
      part[i].store(lanes);
      for (int64_t j = e; j < D; ++j) {
        const float xh = static_cast<float>(x[i][j]) * r[i];
        dw[j] += gs[i][j] * xh;
        lanes[0] += gs[i][j] * w[j] * xh;
      }
      mean[i] = lanes_sum(lanes) / static_cast<float>(D);
    }
  }
  // dx = r * (gu * w - xhat * mean), math::qk_norm_grad_input.
  for (int i = 0; i < kG; ++i) {
    const Vec rv(r[i]), mv(mean[i]);
    auto dx_vec = [&](int64_t j) {
      const Vec xh = load_float8(x[i] + j) * rv;
      return rv * (Vec::loadu(gs[i] + j) * Vec::loadu(w + j) - xh * mv);
    };
    int64_t j = 0;
    // As at::vec::convert(float -> scalar_t) for half precision: 16 values per vector
    // conversion, then one by one.
    auto store_rows = [&](auto kStream) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        for (; j + W <= D; j += W) store_vec<decltype(kStream)::value>(dx_vec(j), dx[i] + j);
      } else {
        for (; j + 2 * W <= D; j += 2 * W) {
          store_vec<decltype(kStream)::value>(at::vec::convert_from_float<scalar_t>(dx_vec(j), dx_vec(j + W)),
                                              dx[i] + j);
        }
      }
    };
    if (stream && x[i] != dx[i] && row_can_stream<scalar_t>(dx[i], D)) {
      store_rows(std::true_type{});
    } else {
      store_rows(std::false_type{});
    }
    const int64_t jv = D / W * W;  // the scalar loop's first feature
    for (; j < jv; j += W) {
      alignas(32) float tmp[W];
      dx_vec(j).store(tmp);
      for (int64_t l = 0; l < W; ++l) dx[i][j + l] = static_cast<scalar_t>(tmp[l]);
    }
    for (; j < D; ++j) {
      dx[i][j] = static_cast<scalar_t>(
          math::qk_norm_grad_input(gs[i][j], w[j], static_cast<float>(x[i][j]) * r[i], mean[i], r[i]));
    }
  }
}

#if defined(__GNUC__) || defined(__clang__)
// backward_heads_vec on CPUs with AVX-512 (compiled by target attribute, called where
// cpu_has_avx512()), for rows that are all rotary halves of whole 16-lane vectors: the
// elementwise passes (the gradient turned back, the squares, the weight gradient's terms,
// dx) 16 lanes wide, in half the instructions (bfloat16 0.89x, float16 0.92x, float32
// 0.93x: benchmarks/NOTES.md). Each value is rounded as there, and the sums keep
// backward_heads_vec's 8-lane order (the two 8-lane halves of each 16-lane product added in
// element order; the squares of the second half staged, as there all are), so the same bits
// (test_cpu_capability.py compares the levels).
POSENC_AVX512_WARNINGS_BEGIN
template <typename scalar_t, int kG>
POSENC_AVX512_TARGET void backward_heads_avx512(const QkNormRopeArgs& a, const scalar_t* const (&x)[kG],
                                                const scalar_t* const (&g)[kG], scalar_t* const (&dx)[kG],
                                                const float* w, float* dw, const TokenAngles<float>& t,
                                                bool stream) {
  const int64_t D = a.rope.head_dim, half = D / 2;
  const float eps = static_cast<float>(a.eps);
  alignas(64) float gs[kG][kStagedRow];
  alignas(64) float sq2[kG][kStagedRow / 2];  // the squares of the second half, in order
  float r[kG], mean[kG];
  for (int i = 0; i < kG; ++i) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t p = 0; p < half; p += 16) {
      const __m512 x1 = load16(x[i] + p), x2 = load16(x[i] + half + p);
      const __m512 g1 = load16(g[i] + p), g2 = load16(g[i] + half + p);
      const __m512 c = _mm512_loadu_ps(t.cs + p), sn = _mm512_loadu_ps(t.sn + p);
      // rotate_vec: g1 c - g2 s and g2 c + g1 s, each one product and one fused multiply-add.
      _mm512_store_ps(gs[i] + p, _mm512_fmsub_ps(g1, c, _mm512_mul_ps(g2, sn)));
      _mm512_store_ps(gs[i] + half + p, _mm512_fmadd_ps(g2, c, _mm512_mul_ps(g1, sn)));
      acc = add8(acc, _mm512_mul_ps(x1, x1));
      _mm512_store_ps(sq2[i] + p, _mm512_mul_ps(x2, x2));
    }
    for (int64_t p = 0; p < half; p += 8) acc = _mm256_add_ps(acc, _mm256_load_ps(sq2[i] + p));
    float lanes[kLanes];
    _mm256_storeu_ps(lanes, acc);
    r[i] = math::qk_norm_inv_rms<float>(lanes_sum(lanes), D, eps);
  }
  // The weight gradient's terms (heads in order per feature) and mean(gu * w * xhat).
  {
    __m512 rv[kG];
    __m256 part[kG];
    for (int i = 0; i < kG; ++i) {
      rv[i] = _mm512_set1_ps(r[i]);
      part[i] = _mm256_setzero_ps();
    }
    for (int64_t e = 0; e < D; e += 16) {
      __m512 d = _mm512_loadu_ps(dw + e);
      const __m512 wv = _mm512_loadu_ps(w + e);
      for (int i = 0; i < kG; ++i) {
        const __m512 gv = _mm512_load_ps(gs[i] + e), xh = _mm512_mul_ps(load16(x[i] + e), rv[i]);
        d = _mm512_add_ps(d, _mm512_mul_ps(gv, xh));
        part[i] = add8(part[i], _mm512_mul_ps(_mm512_mul_ps(gv, wv), xh));
      }
      _mm512_storeu_ps(dw + e, d);
    }
    for (int i = 0; i < kG; ++i) {
      float lanes[kLanes];
      _mm256_storeu_ps(lanes, part[i]);
      mean[i] = lanes_sum(lanes) / static_cast<float>(D);
    }
  }
  // dx = r * (gu * w - xhat * mean), math::qk_norm_grad_input, narrowed as ATen rounds.
  for (int i = 0; i < kG; ++i) {
    const __m512 rv = _mm512_set1_ps(r[i]), mv = _mm512_set1_ps(mean[i]);
    const bool streamed = stream && x[i] != dx[i] && row_can_stream<scalar_t>(dx[i], D);
    for (int64_t j = 0; j < D; j += 16) {
      const __m512 xh = _mm512_mul_ps(load16(x[i] + j), rv);
      const __m512 v = _mm512_mul_ps(rv, _mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(gs[i] + j),
                                                                     _mm512_loadu_ps(w + j)),
                                                       _mm512_mul_ps(xh, mv)));
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (streamed) {  // rows 32-byte aligned (row_can_stream): two 256-bit streaming stores
          _mm256_stream_ps(dx[i] + j, _mm512_castps512_ps256(v));
          _mm256_stream_ps(dx[i] + j + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        } else {
          _mm512_storeu_ps(dx[i] + j, v);
        }
      } else {
        auto* out = reinterpret_cast<__m256i*>(dx[i] + j);
        if (streamed) {
          _mm256_stream_si256(out, narrow16<scalar_t>(v));
        } else {
          _mm256_storeu_si256(out, narrow16<scalar_t>(v));
        }
      }
    }
  }
}
POSENC_AVX512_WARNINGS_END
#endif
#endif

template <typename scalar_t, typename acc_t, bool kC, bool kIl>
void backward_operand(const QkNormRopeArgs& a, const RopeOperand& op, const RopeOperand& gop,
                      const acc_t* w, acc_t* dw, int64_t b, int64_t s, const TokenAngles<acc_t>& t,
                      bool stream) {
  const int64_t D = a.rope.head_dim;
  const bool hidden = a.norm == QkNorm::kHidden;
  auto sums = [&](int64_t h, acc_t r, acc_t (&part)[kLanes]) {
    const int64_t wo = hidden ? h * D : 0;
    backward_row_sums<scalar_t, acc_t, kC, kIl>(a, row_in<scalar_t>(op, b, s, h), op.in_stride[3],
                                           row_in<scalar_t>(gop, b, s, h), gop.in_stride[3],
                                           w + wo, r, t, dw + wo, part);
  };
  auto write = [&](int64_t h, acc_t r, acc_t mean_gx) {
    const int64_t wo = hidden ? h * D : 0;
    backward_row_dx<scalar_t, acc_t, kC, kIl>(a, row_in<scalar_t>(op, b, s, h), op.in_stride[3],
                                         row_in<scalar_t>(gop, b, s, h), gop.in_stride[3],
                                         row_out<scalar_t>(op, b, s, h), op.out_stride[3], w + wo,
                                         r, mean_gx, t);
  };
  if (hidden) {
    if (op.heads == 0 || D == 0) return;
    const acc_t r = inv_rms_of<scalar_t, acc_t, kC>(a, op, b, s, 0, op.heads);
    acc_t part[kLanes] = {};
    for (int64_t h = 0; h < op.heads; ++h) sums(h, r, part);
    const acc_t mean_gx = lanes_sum(part) / static_cast<acc_t>(op.heads * D);
    for (int64_t h = 0; h < op.heads; ++h) write(h, r, mean_gx);
    return;
  }
  if (D <= kStagedRow) {
    // Norm "head" with short rows: each row of x and of the gradient is read once, widened
    // into the compute type on the stack, and the passes run there (no re-reading, no
    // second turn of the gradient).
    const int64_t half = a.rope.rotary_dim / 2;
    const int64_t o = math::rope_rotary_begin(a.rope.settings);
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (kC && !kIl && std::is_same_v<acc_t, float>) {
      int64_t h = 0;
      // backward_heads_avx512's rows: all rotary halves, of whole 16-lane vectors.
      [[maybe_unused]] const bool wide = cpu_has_avx512() && o == 0 && 2 * half == D && half % 16 == 0;
      auto group = [&](auto kG_tag) {
        constexpr int kG = decltype(kG_tag)::value;
        const scalar_t* x[kG];
        const scalar_t* g[kG];
        scalar_t* dx[kG];
        for (int i = 0; i < kG; ++i) {
          x[i] = row_in<scalar_t>(op, b, s, h + i);
          g[i] = row_in<scalar_t>(gop, b, s, h + i);
          dx[i] = row_out<scalar_t>(op, b, s, h + i);
        }
        if constexpr (!std::is_same_v<scalar_t, float>) {
          // Half precision only: in float32 the hardware prefetchers follow the rows, and
          // these hints stalled on full miss buffers (perf: 60% of backward_operand's
          // samples on one prefetcht0).
          prefetch_rows<scalar_t>(op, b, s, h, kG, D);
          prefetch_rows<scalar_t>(gop, b, s, h, kG, D);
        }
#if defined(__GNUC__) || defined(__clang__)
        if (wide) {
          backward_heads_avx512<scalar_t, kG>(a, x, g, dx, w, dw, t, stream);
          h += kG;
          return;
        }
#endif
        backward_heads_vec<scalar_t, kG>(a, x, g, dx, w, dw, t, stream);
        h += kG;
      };
      while (h + 4 <= op.heads) group(std::integral_constant<int, 4>{});
      switch (op.heads - h) {
        case 3: group(std::integral_constant<int, 3>{}); break;
        case 2: group(std::integral_constant<int, 2>{}); break;
        case 1: group(std::integral_constant<int, 1>{}); break;
        default: break;
      }
      return;
    }
#endif
    alignas(64) acc_t xs[kStagedRow], gs[kStagedRow];
    if constexpr (kC && !kIl && std::is_same_v<acc_t, float> && Vectorized<float>::size() == kLanes) {
      // Contiguous half-split rows in float32 arithmetic: the same passes in explicit
      // vectors (gcc left them scalar), each operation as the scalar loop below rounds it
      // (no contraction: CMakeLists.txt), so the same bits.
      using Vec = Vectorized<float>;
      constexpr int64_t W = Vec::size();
      alignas(64) float dxs[kStagedRow];
      for (int64_t h = 0; h < op.heads; ++h) {
        widen_row(row_in<scalar_t>(op, b, s, h), xs, D);
        widen_row(row_in<scalar_t>(gop, b, s, h), gs, D);
        acc_t sq[kLanes] = {};
        add_squares<acc_t, acc_t, true>(xs, 1, D, sq);
        const acc_t r = math::qk_norm_inv_rms<acc_t>(lanes_sum(sq), D, static_cast<acc_t>(a.eps));
        const Vec rv(r);
        int64_t p = 0;
        for (; p + W <= half; p += W) {  // the gradient turned back
          Vec gu1, gu2;
          rotate_vec(Vec::loadu(gs + o + p), Vec::loadu(gs + o + half + p), Vec::loadu(t.cs + p),
                     Vec::loadu(t.sn + p), gu1, gu2);
          gu1.store(gs + o + p);
          gu2.store(gs + o + half + p);
        }
        for (; p < half; ++p) {
          acc_t gu1, gu2;
          math::rope_rotate_pair(gs[o + p], gs[o + p + half], t.cs[p], t.sn[p], &gu1, &gu2);
          gs[o + p] = gu1;
          gs[o + p + half] = gu2;
        }
        Vec part = Vec(0.0f);
        int64_t e = 0;
        for (; e + W <= D; e += W) {
          const Vec g = Vec::loadu(gs + e), xh = Vec::loadu(xs + e) * rv;
          (Vec::loadu(dw + e) + g * xh).store(dw + e);
          part = part + g * Vec::loadu(w + e) * xh;
        }
        acc_t lanes[kLanes];
        part.store(lanes);
        for (; e < D; ++e) {
          const acc_t xh = xs[e] * r;
          dw[e] += gs[e] * xh;
          lanes[0] += gs[e] * w[e] * xh;
        }
        const acc_t mean_gx = lanes_sum(lanes) / static_cast<acc_t>(D);
        const Vec mv(mean_gx);
        int64_t j = 0;
        for (; j + W <= D; j += W) {  // math::qk_norm_grad_input: r * (gu * w - xhat * mean)
          const Vec xh = Vec::loadu(xs + j) * rv;
          (rv * (Vec::loadu(gs + j) * Vec::loadu(w + j) - xh * mv)).store(dxs + j);
        }
        for (; j < D; ++j) dxs[j] = math::qk_norm_grad_input(gs[j], w[j], xs[j] * r, mean_gx, r);
        at::vec::convert(dxs, row_out<scalar_t>(op, b, s, h), D);
      }
      return;
    }
    for (int64_t h = 0; h < op.heads; ++h) {
      const scalar_t* x = row_in<scalar_t>(op, b, s, h);
      const scalar_t* g = row_in<scalar_t>(gop, b, s, h);
      const int64_t sx = op.in_stride[3], sg = gop.in_stride[3];
      for (int64_t e = 0; e < D; ++e) {
        xs[e] = static_cast<acc_t>(x[at_<kC>(e, sx)]);
        gs[e] = static_cast<acc_t>(g[at_<kC>(e, sg)]);
      }
      acc_t sq[kLanes] = {};
      add_squares<acc_t, acc_t, true>(xs, 1, D, sq);
      const acc_t r = math::qk_norm_inv_rms<acc_t>(lanes_sum(sq), D, static_cast<acc_t>(a.eps));
      for (int64_t p = 0; p < half; ++p) {  // the gradient turned back
        const int64_t e1 = o + (kIl ? 2 * p : p), e2 = o + (kIl ? 2 * p + 1 : p + half);
        acc_t gu1, gu2;
        math::rope_rotate_pair(gs[e1], gs[e2], t.cs[p], t.sn[p], &gu1, &gu2);
        gs[e1] = gu1;
        gs[e2] = gu2;
      }
      acc_t part[kLanes] = {};
      int64_t e = 0;
      for (; e + kLanes <= D; e += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          const acc_t xh = xs[e + l] * r;
          dw[e + l] += gs[e + l] * xh;
          part[l] += gs[e + l] * w[e + l] * xh;
        }
      }
      for (; e < D; ++e) {
        const acc_t xh = xs[e] * r;
        dw[e] += gs[e] * xh;
        part[0] += gs[e] * w[e] * xh;
      }
      const acc_t mean_gx = lanes_sum(part) / static_cast<acc_t>(D);
      scalar_t* dx = row_out<scalar_t>(op, b, s, h);
      const int64_t sd = op.out_stride[3];
      for (int64_t j = 0; j < D; ++j) {
        dx[at_<kC>(j, sd)] =
            static_cast<scalar_t>(math::qk_norm_grad_input(gs[j], w[j], xs[j] * r, mean_gx, r));
      }
    }
    return;
  }
  for (int64_t h = 0; h < op.heads; ++h) {
    const acc_t r = inv_rms_of<scalar_t, acc_t, kC>(a, op, b, s, h, h + 1);
    acc_t part[kLanes] = {};
    sums(h, r, part);
    write(h, r, lanes_sum(part) / static_cast<acc_t>(D));
  }
}

bool contiguous_rows(const QkNormRopeArgs& a, bool backward) {
  for (const RopeOperand* op : {&a.rope.q, &a.rope.k}) {
    if (op->heads > 0 && (op->in_stride[3] != 1 || op->out_stride[3] != 1)) return false;
  }
  if (backward) {
    for (const RopeOperand* op : {&a.grad_q, &a.grad_k}) {
      if (op->heads > 0 && op->in_stride[3] != 1) return false;
    }
  }
  return true;
}

template <typename scalar_t, bool kC>
void run_tokens(const QkNormRopeArgs& a, bool backward, int64_t chunks) {
  using acc_t = at::opmath_type<scalar_t>;
  const RopeArgs& ra = a.rope;
  const int64_t tokens = ra.batch * ra.seq;
  if (tokens == 0) return;
  const auto* wq = static_cast<const acc_t*>(a.q_weight);
  const auto* wk = static_cast<const acc_t*>(a.k_weight);
  const bool hidden = a.norm == QkNorm::kHidden;
  // Outputs (the forward's q and k, the backward's dx) of kStreamBytes or more go out with
  // streaming stores where a row allows them (rope_rows.h), fenced before each task ends.
  const int64_t written = tokens * (ra.q.heads + ra.k.heads) * ra.head_dim * static_cast<int64_t>(sizeof(scalar_t));
  const bool stream = written >= kStreamBytes;
  const int64_t lq = hidden ? ra.q.heads * ra.head_dim : ra.head_dim;
  const int64_t lk = hidden ? ra.k.heads * ra.head_dim : ra.head_dim;
  // One token's work: its angles, then q and k (NaN rows for a packed token outside every
  // sequence; its gradients are NaN too, and it adds nothing to the weight gradients).
  auto token = [&](int64_t item, TokenAngles<acc_t>& angles, acc_t* dwq, acc_t* dwk) {
    const int64_t b = item / ra.seq, s = item % ra.seq;
    int64_t pos[math::kRopeMaxAxes];
    if (!token_positions(ra, b, s, pos)) {
      nan_rows<scalar_t>(a, ra.q, b, s);
      nan_rows<scalar_t>(a, ra.k, b, s);
      return;
    }
    token_angles<acc_t>(ra, pos, angles);
    if (!backward) {
      forward_operand<scalar_t, acc_t, kC>(a, ra.q, wq, b, s, angles, stream);
      forward_operand<scalar_t, acc_t, kC>(a, ra.k, wk, b, s, angles, stream);
    } else {
      if (ra.interleaved) {
        backward_operand<scalar_t, acc_t, kC, true>(a, ra.q, a.grad_q, wq, dwq, b, s, angles, stream);
        backward_operand<scalar_t, acc_t, kC, true>(a, ra.k, a.grad_k, wk, dwk, b, s, angles, stream);
      } else {
        backward_operand<scalar_t, acc_t, kC, false>(a, ra.q, a.grad_q, wq, dwq, b, s, angles, stream);
        backward_operand<scalar_t, acc_t, kC, false>(a, ra.k, a.grad_k, wk, dwk, b, s, angles, stream);
      }
    }
  };
  if (!backward) {
    const int64_t row_elems = std::max<int64_t>(1, (ra.q.heads + ra.k.heads) * ra.head_dim);
    const int64_t grain = std::max<int64_t>(1, 32768 / row_elems);
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      TokenAngles<acc_t> angles;
      for (int64_t item = begin; item < end; ++item) token(item, angles, nullptr, nullptr);
      if (stream) stream_fence();
    });
    return;
  }
  // Backward: chunk c of the fixed split sums its tokens' weight-gradient terms into row c.
  auto* dq = static_cast<acc_t*>(a.q_weight_grad);
  auto* dk = static_cast<acc_t*>(a.k_weight_grad);
  const int64_t per_chunk = (tokens + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    TokenAngles<acc_t> angles;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t last = std::min(tokens, (c + 1) * per_chunk);
      for (int64_t item = c * per_chunk; item < last; ++item) {
        token(item, angles, dq + c * lq, dk + c * lk);
      }
    }
    if (stream) stream_fence();
  });
  // Row 0 = the chunks' sums, added in chunk order.
  for (const auto& [buf, len] : {std::pair<acc_t*, int64_t>{dq, lq}, {dk, lk}}) {
    at::parallel_for(0, len, 256, [&, buf = buf, len = len](int64_t begin, int64_t end) {
      for (int64_t c = 1; c < chunks; ++c) {
        for (int64_t e = begin; e < end; ++e) buf[e] += buf[c * len + e];
      }
    });
  }
}

void qk_norm_rope_kernel(const QkNormRopeArgs& a, c10::ScalarType dtype, bool backward,
                         int64_t chunks) {
  dispatch_floating(dtype, "posenc_qk_norm_rope_cpu", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    if (contiguous_rows(a, backward)) {
      run_tokens<scalar_t, true>(a, backward, chunks);
    } else {
      run_tokens<scalar_t, false>(a, backward, chunks);
    }
  });
}

}  // namespace
POSENC_ISA_NAMESPACE_END

POSENC_REGISTER_DISPATCH(qk_norm_rope_stub, &qk_norm_rope_kernel)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
