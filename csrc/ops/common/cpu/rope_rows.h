// The per-token pieces of the CPU RoPE kernel (cpu/kernel.cpp), shared with the kernels that
// rotate on the way to somewhere else (rope_append_kv's cache write): a token's angles and
// positions, and the rotation of one row (at::vec paths for contiguous rows, a scalar loop
// for any strides). Only for the vector-ISA translation units (POSENC_ISA_SOURCES): every
// function lives in the ISA namespace (posenc/math/host_device.h).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <cstring>
#include <utility>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "ops/common/cpu/half_lanes.h"
#include "ops/common/rope_args.h"
#include "posenc/math/host_device.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN

using at::vec::Vectorized;

// The row functions below run once per row (a head of a token: 64-256 features), thousands
// of times a call: inlined into their callers' head loops, a row costs no call, no stack
// realignment (their vector locals) and no spills (perf: those were a third of a
// 64-feature row's time).
#if defined(__GNUC__)
#define POSENC_ROW_INLINE inline __attribute__((always_inline))
#else
#define POSENC_ROW_INLINE inline
#endif

// cos and sin of one token, already multiplied by the attention factor (sin negated for the
// inverse rotation). cs2 and sn2 hold them again in the order a vector path reads them
// (fill_pair_angles writes them; token_angles calls it, and so must a kernel that builds its
// own angles): interleaved rows (adjacent pairs) once per feature, cs2[2i] = cs2[2i + 1] =
// cs[i], so a vector of the row rotates as it lies in memory (rotate_paired_vec); rows of
// split halves (AVX2 builds), per group of 16 pairs in the order AVX2's in-lane bfloat16
// widening leaves them (widen_bf16_lanes: pairs 0-3, 8-11, then 4-7, 12-15).
template <typename acc_t>
struct TokenAngles {
  acc_t cs[kMaxRopePairs];
  acc_t sn[kMaxRopePairs];
  acc_t cs2[2 * kMaxRopePairs];
  acc_t sn2[2 * kMaxRopePairs];
};

// TokenAngles' cs2 and sn2 from its cs and sn.
template <typename acc_t>
inline void fill_pair_angles(const RopeArgs& a, TokenAngles<acc_t>& t) {
  const int64_t half = a.rotary_dim / 2;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {  // the same moves, 8 values at a time
    for (const auto& [from, to] : {std::pair<const float*, float*>{t.cs, t.cs2}, {t.sn, t.sn2}}) {
      if (a.interleaved) {
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 v = _mm256_loadu_ps(from + i);
          const __m256 lo = _mm256_unpacklo_ps(v, v), hi = _mm256_unpackhi_ps(v, v);
          _mm256_storeu_ps(to + 2 * i, _mm256_permute2f128_ps(lo, hi, 0x20));
          _mm256_storeu_ps(to + 2 * i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
        for (; i < half; ++i) to[2 * i] = to[2 * i + 1] = from[i];
      } else {
        for (int64_t g = 0; g + 16 <= half; g += 16) {
          const __m256 v0 = _mm256_loadu_ps(from + g), v1 = _mm256_loadu_ps(from + g + 8);
          _mm256_storeu_ps(to + g, _mm256_permute2f128_ps(v0, v1, 0x20));
          _mm256_storeu_ps(to + g + 8, _mm256_permute2f128_ps(v0, v1, 0x31));
        }
      }
    }
    return;
  }
#endif
  // Elsewhere only interleaved rows read cs2 and sn2 (the lane order of split halves is the
  // AVX2 bfloat16 path's alone).
  if (a.interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      t.cs2[2 * i] = t.cs2[2 * i + 1] = t.cs[i];
      t.sn2[2 * i] = t.sn2[2 * i + 1] = t.sn[i];
    }
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// Per-feature float32 values of a half-split rotary part (src: 2 * half values, the two
// halves' features) in the lane order of widen_bf16_lanes, for the vector paths that widen
// in that order: each half's groups of 16 from its start reordered (elements 0-3, 8-11,
// then 4-7, 12-15), as fill_pair_angles orders cs2 / sn2; the rest of dst unset (the
// pairs past the last whole group read src).
inline void lane_order_halves(const float* src, int64_t half, float* dst) {
  for (const int64_t base : {int64_t{0}, half}) {
    for (int64_t g = 0; g + 16 <= half; g += 16) {
      const __m256 v0 = _mm256_loadu_ps(src + base + g), v1 = _mm256_loadu_ps(src + base + g + 8);
      _mm256_storeu_ps(dst + base + g, _mm256_permute2f128_ps(v0, v1, 0x20));
      _mm256_storeu_ps(dst + base + g + 8, _mm256_permute2f128_ps(v0, v1, 0x31));
    }
  }
}

#endif

#if defined(CPU_CAPABILITY_AVX2)
// math::rope_sincos<float> for eight pairs at once, step by step in AVX2: the same IEEE
// operations (products, FMAs, rint, floor, conversions: each rounded once, as the scalar
// ones are) and the same selects, so the same bits; the compiler does not vectorise the
// scalar form (its double reduction feeds a float polynomial). Angles pos[i] * inv[i]; the
// double-precision steps in two halves of four lanes, the float steps eight lanes wide.
// The positions come as two vectors of four (pos_lo: pairs 0-3, pos_hi: 4-7).
inline void rope_sincos8(__m256d pos_lo, __m256d pos_hi, const double* inv, __m256* s_out, __m256* c_out) {
  const __m256d sign64 = _mm256_set1_pd(-0.0);
  __m128 rf_half[2], q_half[2];
  for (int h = 0; h < 2; ++h) {
    const __m256d angle = _mm256_mul_pd(h == 0 ? pos_lo : pos_hi, _mm256_loadu_pd(inv + 4 * h));
    const __m256d k0 = _mm256_round_pd(_mm256_mul_pd(angle, _mm256_set1_pd(0.63661977236758134308)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256d nk0 = _mm256_xor_pd(k0, sign64);
    const __m256d r0 = _mm256_fmadd_pd(nk0, _mm256_set1_pd(6.1232339957367658e-17),
                                       _mm256_fmadd_pd(nk0, _mm256_set1_pd(1.5707963267948965580e+00), angle));
    // rope_sincos's second step back into [-pi/4, pi/4] (adjust = rint(r0 * 2/pi) where
    // |r0| > kRopeReduceLimit, else 0, which leaves r0 as it is) and its quadrant from
    // k0 mod 4 plus adjust, taken only when a lane needs it (angles past ~2^42): the same
    // bits, and the common case pays one compare.
    const __m256d limit = _mm256_set1_pd(math::kRopeReduceLimit);
    const __m256d four = _mm256_set1_pd(4.0);
    __m256d r = r0;
    __m256d q64 = _mm256_sub_pd(k0, _mm256_mul_pd(four, _mm256_floor_pd(_mm256_mul_pd(k0, _mm256_set1_pd(0.25)))));
    const __m256d far = _mm256_cmp_pd(_mm256_andnot_pd(sign64, r0), limit, _CMP_GT_OQ);
    if (_mm256_movemask_pd(far) != 0) {
      const __m256d adjust = _mm256_and_pd(
          far, _mm256_round_pd(_mm256_mul_pd(r0, _mm256_set1_pd(0.63661977236758134308)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256d na = _mm256_xor_pd(adjust, sign64);
      r = _mm256_fmadd_pd(na, _mm256_set1_pd(6.1232339957367658e-17),
                          _mm256_fmadd_pd(na, _mm256_set1_pd(1.5707963267948965580e+00), r0));
      const __m256d q_sum = _mm256_add_pd(q64, adjust);  // rope_sincos's residue mod 4, by floor
      q64 = _mm256_sub_pd(q_sum, _mm256_mul_pd(four, _mm256_floor_pd(_mm256_mul_pd(q_sum, _mm256_set1_pd(0.25)))));
    }
    rf_half[h] = _mm256_cvtpd_ps(r);
    q_half[h] = _mm256_cvtpd_ps(q64);
  }
  const __m256 rf = _mm256_insertf128_ps(_mm256_castps128_ps256(rf_half[0]), rf_half[1], 1);
  const __m256 q = _mm256_insertf128_ps(_mm256_castps128_ps256(q_half[0]), q_half[1], 1);
  const __m256 r2 = _mm256_mul_ps(rf, rf);
  const __m256 ps = _mm256_fmadd_ps(
      r2, _mm256_fmadd_ps(r2, _mm256_set1_ps(-1.9515295891e-4f), _mm256_set1_ps(8.3321608736e-3f)),
      _mm256_set1_ps(-1.6666654611e-1f));
  const __m256 sr = _mm256_fmadd_ps(_mm256_mul_ps(rf, r2), ps, rf);
  const __m256 pc = _mm256_fmadd_ps(
      r2, _mm256_fmadd_ps(r2, _mm256_set1_ps(2.443315711809948e-5f), _mm256_set1_ps(-1.388731625493765e-3f)),
      _mm256_set1_ps(4.166664568298827e-2f));
  const __m256 cr = _mm256_fmadd_ps(_mm256_mul_ps(r2, r2), pc,
                                    _mm256_fmadd_ps(_mm256_set1_ps(-0.5f), r2, _mm256_set1_ps(1.0f)));
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), three = _mm256_set1_ps(3.0f);
  const __m256 swap = _mm256_or_ps(_mm256_cmp_ps(q, one, _CMP_EQ_OQ), _mm256_cmp_ps(q, three, _CMP_EQ_OQ));
  const __m256 ss = _mm256_blendv_ps(sr, cr, swap);
  const __m256 cc = _mm256_blendv_ps(cr, sr, swap);
  const __m256 sign32 = _mm256_set1_ps(-0.0f);
  const __m256 neg_s = _mm256_cmp_ps(q, two, _CMP_GE_OQ);
  const __m256 neg_c = _mm256_or_ps(_mm256_cmp_ps(q, one, _CMP_EQ_OQ), _mm256_cmp_ps(q, two, _CMP_EQ_OQ));
  *s_out = _mm256_xor_ps(ss, _mm256_and_ps(neg_s, sign32));
  *c_out = _mm256_xor_ps(cc, _mm256_and_ps(neg_c, sign32));
}

inline void rope_sincos8(const double* pos, const double* inv, __m256* s_out, __m256* c_out) {
  rope_sincos8(_mm256_loadu_pd(pos), _mm256_loadu_pd(pos + 4), inv, s_out, c_out);
}
#endif

// The cos and sin of a token whose position on axis a is pos[a] (one axis for plain RoPE),
// times the attention factor (sin negated for the inverse rotation), into cs[0, half) and
// sn[0, half): TokenAngles' cs and sn, or a table's row (rope_shift_kv's shared angles).
template <typename acc_t>
void token_cos_sin(const RopeArgs& a, const int64_t* pos, acc_t* cs, acc_t* sn) {
  const acc_t factor = static_cast<acc_t>(a.attention_factor);
  const acc_t sign = a.inverse ? acc_t(-1) : acc_t(1);
  const int64_t half = a.rotary_dim / 2;
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    // One axis (every pair turns with position pos[0]): the position broadcast, not gathered
    // pair by pair.
    const bool one_axis = a.n_axes == 1;
    alignas(32) double posd[kMaxRopePairs];
    if (!one_axis) {
      for (int64_t j = 0; j < half; ++j) posd[j] = static_cast<double>(pos[a.pair_axis[j]]);
    }
    const __m256d p4 = _mm256_set1_pd(static_cast<double>(pos[0]));
    const __m256 f8 = _mm256_set1_ps(factor), fs8 = _mm256_set1_ps(sign);
    for (; i + 8 <= half; i += 8) {
      __m256 s, c;
      if (one_axis) {
        rope_sincos8(p4, p4, a.inv_freq + i, &s, &c);
      } else {
        rope_sincos8(posd + i, a.inv_freq + i, &s, &c);
      }
      _mm256_storeu_ps(cs + i, _mm256_mul_ps(c, f8));
      _mm256_storeu_ps(sn + i, _mm256_mul_ps(_mm256_mul_ps(s, f8), fs8));
    }
    if (i < half) {  // the last 1-7 pairs, in lanes padded with zero angles
      alignas(32) double pos8[8] = {}, inv8[8] = {};
      alignas(32) float c8[8], s8[8];
      for (int64_t j = i; j < half; ++j) {
        pos8[j - i] = one_axis ? static_cast<double>(pos[0]) : posd[j];
        inv8[j - i] = a.inv_freq[j];
      }
      __m256 s, c;
      rope_sincos8(pos8, inv8, &s, &c);
      _mm256_store_ps(c8, _mm256_mul_ps(c, f8));
      _mm256_store_ps(s8, _mm256_mul_ps(_mm256_mul_ps(s, f8), fs8));
      for (int64_t j = i; j < half; ++j) {
        cs[j] = c8[j - i];
        sn[j] = s8[j - i];
      }
      i = half;
    }
  }
#endif
  for (; i < half; ++i) {
    acc_t s, c;
    math::rope_sincos<acc_t>(pos[a.pair_axis[i]], a.inv_freq[i], &s, &c);
    cs[i] = c * factor;
    sn[i] = s * factor * sign;
  }
}

// The angles of a token whose position on axis a is pos[a] (token_cos_sin); with
// `pair_angles` false, cs and sn alone (angles that only feed others: rope_shift_kv's).
template <typename acc_t>
void token_angles(const RopeArgs& a, const int64_t* pos, TokenAngles<acc_t>& t, bool pair_angles = true) {
  token_cos_sin<acc_t>(a, pos, t.cs, t.sn);
  if (pair_angles) fill_pair_angles(a, t);
}

// The coordinates of token (b, s) on every axis; false for a packed token outside every
// sequence.
inline bool token_positions(const RopeArgs& a, int64_t b, int64_t s, int64_t* pos) {
  int64_t shift = 0, restart = 0;
  if (!rope_token_shift(a, b, s, &shift, &restart)) return false;
  for (int64_t axis = 0; axis < a.n_axes; ++axis) {
    pos[axis] = rope_axis_position(a, b, s, shift, restart, axis);
  }
  return true;
}

// Pair (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), rounded as math::rope_rotate_pair.
template <typename scalar_t, typename acc_t>
inline void rotate_pair(const scalar_t* in, int64_t i1, int64_t i2, scalar_t* out, int64_t o1,
                        int64_t o2, acc_t c, acc_t s) {
  acc_t y1, y2;
  math::rope_rotate_pair(static_cast<acc_t>(in[i1]), static_cast<acc_t>(in[i2]), c, s, &y1, &y2);
  out[o1] = static_cast<scalar_t>(y1);
  out[o2] = static_cast<scalar_t>(y2);
}

// math::rope_rotate_pair on vectors: one rounded product, one fused multiply-add per output.
template <typename Vec>
inline Vec fma_vec(const Vec& a, const Vec& b, const Vec& c) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return at::vec::fmadd(a, b, c);
#else
  // The baseline's at::vec::fmadd is a * b + c rounded twice: std::fma per lane keeps the
  // AVX2 build's bits (tests/python/test_cpu_capability.py).
  using T = typename Vec::value_type;
  alignas(64) T va[Vec::size()], vb[Vec::size()], vc[Vec::size()];
  a.store(va);
  b.store(vb);
  c.store(vc);
  for (int64_t i = 0; i < Vec::size(); ++i) va[i] = std::fma(va[i], vb[i], vc[i]);
  return Vec::loadu(va);
#endif
}

// Non-temporal ("streaming") stores: for outputs too large to stay in the caches, a store
// that goes to memory without first reading the line it overwrites (the read-for-ownership
// of a plain store: a third of the traffic of a pass that reads and writes as much). Only the
// AVX2 build has them; everywhere else kStream is a plain store. The address must be aligned
// to the vector (rows_can_stream checks); stream_fence() must follow the last of them before
// another thread may read the data (they are weakly ordered).
constexpr bool kHasStreamingStores =
#if defined(CPU_CAPABILITY_AVX2)
    true;
#else
    false;
#endif

template <bool kStream, typename Vec, typename T>
inline void store_vec(const Vec& v, T* out) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kStream) {
    static_assert(sizeof(Vec) == 32, "streaming stores of 256-bit vectors only");
    if constexpr (std::is_same_v<T, float>) {
      _mm256_stream_ps(out, v);
    } else if constexpr (std::is_same_v<T, double>) {
      _mm256_stream_pd(out, v);
    } else {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out), v);
    }
    return;
  }
#endif
  v.store(out);
}

// load_widened's way back: two float32 vectors stored as 2 * Vectorized<float>::size()
// values of scalar_t (half precision rounded by ATen's conversion).
template <bool kStream, typename scalar_t>
inline void store_narrowed(const Vectorized<float>& lo, const Vectorized<float>& hi, scalar_t* out) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    store_vec<kStream>(lo, out);
    store_vec<kStream>(hi, out + Vectorized<float>::size());
  } else {
    store_vec<kStream>(at::vec::convert_from_float<scalar_t>(lo, hi), out);
  }
}

// Software prefetch of a token's head rows when they lie apart (rows of a slice of wider
// ones: MLA's q_pe = q[..., 128:], a q split from a fused qkv projection): the hardware
// prefetchers follow contiguous runs, not 4 lines in every 12, so each row otherwise waits
// for its lines in turn (apply_rope in place on q[..., 128:] of a (1, 2048, 16, 192) float32
// q: 1.73 -> 0.65 ms). Prefetches the head_dim features of the row kPrefetchRowsAhead heads
// on from `row` (head stride `head_stride` elements; past a token's last head, the next
// token's rows in "bshd", else a harmless hint: a prefetch never faults; the address is
// computed as an integer, never as a pointer past the tensor), for writing when the rows are
// rotated in place (`for_write`). qk_norm_rows.h's grouped passes prefetch the same distance
// ahead (prefetch_rows).
constexpr int64_t kPrefetchRowsAhead = 4;  // how far ahead (measured with rows of 128 features)
inline bool rows_have_gaps(int64_t head_stride, int64_t feature_stride, int64_t head_dim) {
  return feature_stride == 1 && head_stride > head_dim;
}
// The lines of the n contiguous elements at address `at` (rope_shift_kv prefetches the rows of
// the item kPrefetchRowsAhead on with it).
template <typename scalar_t>
inline void prefetch_row(std::uintptr_t at, int64_t n, bool for_write) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t byte = 0; byte < bytes; byte += 64) {
    const void* line = reinterpret_cast<const void*>(at + static_cast<std::uintptr_t>(byte));
    if (for_write) {
      __builtin_prefetch(line, 1);
    } else {
      __builtin_prefetch(line, 0);
    }
  }
}
template <typename scalar_t>
inline void prefetch_row_ahead(const scalar_t* row, int64_t head_stride, int64_t head_dim, bool for_write) {
  prefetch_row<scalar_t>(reinterpret_cast<std::uintptr_t>(row) +
                             static_cast<std::uintptr_t>(kPrefetchRowsAhead * head_stride * sizeof(scalar_t)),
                         head_dim, for_write);
}

// The tokens of a "bhsd" walk's block (below): each head's rows of the block are one run in
// memory. In float32, runs of 16 KiB (32 rows of 128) cost the out-of-place walk 7-14%
// against runs of 64 KiB (apply_rope "bhsd" (4, 16/4, 1024, 128), 1 and 2 threads,
// benchmarks/NOTES.md; 256 rows measured no better than 128); in half precision the walk is
// compute-bound and a longer block's angles (cs2 / sn2, twice as wide) leave L1: 1.06x at
// 1 thread, so 32 rows there. The longest of 32, 64 and 128 rows (`longest`) that still
// leaves every thread two blocks (`rows` blocks per token block: batch rows walked apart).
constexpr int64_t kWalkBlock = 32, kMaxWalkBlock = 4 * kWalkBlock;
template <typename scalar_t>
inline int64_t walk_block(int64_t seq, int64_t rows, int threads) {
  const int64_t longest = sizeof(scalar_t) >= sizeof(float) ? kMaxWalkBlock : kWalkBlock;
  int64_t block = kWalkBlock;
  while (block < longest && rows * ((seq + 2 * block - 1) / (2 * block)) >= 2 * int64_t{threads}) block *= 2;
  return block;
}

// A walk over heads h of a block of tokens [s0, s1) (the "bhsd" walks: a head's rows of the
// block, then the next head's), rows at base + s * token_stride + h * head_stride: prefetches
// the row the walk reaches kWalkAhead rows after (h, s), this head's or, past s1, the next
// head's (past the last head a harmless hint: prefetch_row never faults), for writing when
// rotated in place. The hardware prefetchers stop at each 4 KiB page and restart at each
// head's run; this covers both (apply_rope "bhsd" (4, 16/4, 1024, 128): 0.75-0.79x).
constexpr int64_t kWalkAhead = 6;  // rows ahead (3 and 12 measured no better)
template <typename scalar_t>
inline void prefetch_walk_ahead(const scalar_t* base, int64_t token_stride, int64_t head_stride, int64_t h,
                                int64_t s, int64_t s0, int64_t s1, int64_t head_dim, bool for_write) {
  const bool same_head = s + kWalkAhead < s1;
  const int64_t sn = same_head ? s + kWalkAhead : s0 + (s + kWalkAhead - s1);
  const int64_t hn = same_head ? h : h + 1;
  prefetch_row<scalar_t>(reinterpret_cast<std::uintptr_t>(base) +
                             static_cast<std::uintptr_t>((sn * token_stride + hn * head_stride) * sizeof(scalar_t)),
                         head_dim, for_write);
}

// Whether a row's stores may stream: the call writes kStreamBytes or more (`large_call`) and
// the row goes somewhere else than where it was read. A row written in place streams
// never: its lines were just loaded (they sit in the cache, owned), so a streaming store
// saves no read-for-ownership and only evicts them. Every CPU kernel that streams
// (rope's, rope_append_kv's q rows and cache rows) asks this, through rotate_row and
// rope_append_kv's copy_row.
inline bool row_streams(bool large_call, const void* in, const void* out) {
  return large_call && in != out;
}

// Whether every vector store of a row of `rotary_dim` features at `out` (contiguous) is
// aligned to 32 bytes: the row's start and each half of it.
template <typename scalar_t>
inline bool rows_can_stream(const void* out, int64_t rotary_dim) {
  return kHasStreamingStores && reinterpret_cast<std::uintptr_t>(out) % 32 == 0 &&
         (rotary_dim / 2 * static_cast<int64_t>(sizeof(scalar_t))) % 32 == 0;
}

// A row computed into an L1 buffer and then streamed whole (apply_rope_cos_sin's kernel,
// whose rotation loop the compiler vectorises): row_can_stream says whether the row of n
// contiguous elements at out starts 32-byte aligned and is whole 32-byte vectors; stream_row
// then copies it with streaming stores (a plain copy without them).
template <typename scalar_t>
inline bool row_can_stream(const void* out, int64_t n) {
  return kHasStreamingStores && reinterpret_cast<std::uintptr_t>(out) % 32 == 0 &&
         (n * static_cast<int64_t>(sizeof(scalar_t))) % 32 == 0;
}

template <typename scalar_t>
inline void stream_row(const scalar_t* staged, scalar_t* out, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
  const auto* from = reinterpret_cast<const char*>(staged);
  auto* to = reinterpret_cast<char*>(out);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(scalar_t)); i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i)));
  }
#else
  std::copy(staged, staged + n, out);
#endif
}

template <typename Vec>
inline void rotate_vec(const Vec& x1, const Vec& x2, const Vec& c, const Vec& s, Vec& y1, Vec& y2) {
  y1 = fma_vec(x1, c, (x2 * s).neg());
  y2 = fma_vec(x2, c, x1 * s);
}

// x with each adjacent pair of lanes swapped: (x1, x0, x3, x2, ...).
template <typename Vec>
inline Vec swap_pairs(const Vec& x) {
  using T = typename Vec::value_type;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float> && sizeof(Vec) == 32) {
    return Vec(_mm256_permute_ps(x, 0xB1));
  } else if constexpr (std::is_same_v<T, double> && sizeof(Vec) == 32) {
    return Vec(_mm256_permute_pd(x, 0x5));
  }
#endif
  alignas(64) T v[Vec::size()];
  x.store(v);
  for (int64_t i = 0; i + 1 < Vec::size(); i += 2) std::swap(v[i], v[i + 1]);
  return Vec::loadu(v);
}

// An interleaved vector (x1, x2 of each pair adjacent) rotated as it lies: with c and s the
// pair's angles per feature (TokenAngles::cs2, sn2), lane 2i gets fma(x1, c, -(x2 s)) and
// lane 2i + 1 fma(x2, c, x1 s): rotate_vec's operations, so its bits (the sign flipped on
// the rounded product, as .neg() does).
// With kOddNegated, the sign goes to the odd lanes instead: fma(x1, c, x2 s) and
// fma(x2, c, -(x1 s)), the transposed rotation of apply_rope_cos_sin's backward (given s
// swapped as x is).
template <typename Vec, bool kOddNegated = false>
inline Vec rotate_paired_vec(const Vec& x, const Vec& c, const Vec& s) {
  using T = typename Vec::value_type;
  // -0.0 in the negated lanes (a constant the compiler folds; no static: the ISA units
  // define no shared symbols, tests/cpp/check_isa_symbols.sh).
  alignas(64) T sign[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) sign[i] = (i % 2 == 1) == kOddNegated ? T(-0.0) : T(0.0);
  return fma_vec(x, c, (swap_pairs(x) * s) ^ Vec::loadu(sign));
}

// 2 * Vectorized<float>::size() values at x as two float32 vectors (the element order kept;
// half precision widened exactly), and back (rounded as ATen rounds), for the row paths
// that treat every dtype alike.
template <typename scalar_t>
inline std::pair<Vectorized<float>, Vectorized<float>> load_widened(const scalar_t* x) {
  using VecF = Vectorized<float>;
  if constexpr (std::is_same_v<scalar_t, float>) {
    return {VecF::loadu(x), VecF::loadu(x + VecF::size())};
  } else {
    auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(x));
    return {lo, hi};
  }
}

// Any strides, any dtype: pair p of the row with element strides si (in) and so (out).
template <typename scalar_t, typename acc_t>
void rotate_row_strided(const RopeArgs& a, const scalar_t* in, int64_t si, scalar_t* out,
                        int64_t so, const TokenAngles<acc_t>& t, int64_t first_pair) {
  const int64_t half = a.rotary_dim / 2;
  for (int64_t p = first_pair; p < half; ++p) {
    int64_t e1, e2;
    math::rope_pair_features(p, half, a.interleaved, &e1, &e2);
    rotate_pair(in, e1 * si, e2 * si, out, e1 * so, e2 * so, t.cs[p], t.sn[p]);
  }
}

// Contiguous rows of float or double: at::vec over pairs, the scalar loop for the tail.
template <typename scalar_t, bool kStream = false>
POSENC_ROW_INLINE void rotate_row_vec(const RopeArgs& a, const scalar_t* in, scalar_t* out,
                    const TokenAngles<scalar_t>& t) {
  using Vec = Vectorized<scalar_t>;
  constexpr int64_t W = Vec::size();
  const int64_t half = a.rotary_dim / 2;
  int64_t p = 0;
  if (!a.interleaved) {
    for (; p + W <= half; p += W) {
      const Vec x1 = Vec::loadu(in + p), x2 = Vec::loadu(in + half + p);
      const Vec c = Vec::loadu(t.cs + p), s = Vec::loadu(t.sn + p);
      Vec y1, y2;
      rotate_vec(x1, x2, c, s, y1, y2);
      store_vec<kStream>(y1, out + p);
      store_vec<kStream>(y2, out + half + p);
    }
  } else {  // a vector is W / 2 pairs as they lie (rotate_paired_vec)
    for (; p + W / 2 <= half; p += W / 2) {
      const Vec y = rotate_paired_vec(Vec::loadu(in + 2 * p), Vec::loadu(t.cs2 + 2 * p), Vec::loadu(t.sn2 + 2 * p));
      store_vec<kStream>(y, out + 2 * p);
    }
  }
  if (p < half) rotate_row_strided<scalar_t, scalar_t>(a, in, 1, out, 1, t, p);
}

// Contiguous rows of bfloat16 or float16: 16 elements per load, widened to two float32
// vectors, rotated in float32 and rounded once on the way back.
template <typename scalar_t, bool kStream = false>
POSENC_ROW_INLINE void rotate_row_vec_reduced(const RopeArgs& a, const scalar_t* in, scalar_t* out,
                            const TokenAngles<float>& t) {
  using VecH = Vectorized<scalar_t>;
  using VecF = Vectorized<float>;
  constexpr int64_t W = VecH::size();  // 2 * VecF::size()
  constexpr int64_t F = VecF::size();
  const int64_t half = a.rotary_dim / 2;
  auto rotate = [&](const VecF& x1, const VecF& x2, int64_t p, VecF& y1, VecF& y2) {
    const VecF c = VecF::loadu(t.cs + p), s = VecF::loadu(t.sn + p);
    rotate_vec(x1, x2, c, s, y1, y2);
  };
  int64_t p = 0;
  if (!a.interleaved) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      // Widened in lane order, angles in that order (cs2, sn2), rotate_vec's operations
      // (fmsub(x1, c, x2 s) is fma(x1, c, -(x2 s))), rounded as ATen rounds.
      for (; p + W <= half; p += W) {
        __m256 x1a, x1b, x2a, x2b;
        widen_bf16_lanes(in + p, x1a, x1b);
        widen_bf16_lanes(in + half + p, x2a, x2b);
        const __m256 ca = _mm256_loadu_ps(t.cs2 + p), cb = _mm256_loadu_ps(t.cs2 + p + F);
        const __m256 sa = _mm256_loadu_ps(t.sn2 + p), sb = _mm256_loadu_ps(t.sn2 + p + F);
        const __m256 y1a = _mm256_fmsub_ps(x1a, ca, _mm256_mul_ps(x2a, sa));
        const __m256 y1b = _mm256_fmsub_ps(x1b, cb, _mm256_mul_ps(x2b, sb));
        const __m256 y2a = _mm256_fmadd_ps(x2a, ca, _mm256_mul_ps(x1a, sa));
        const __m256 y2b = _mm256_fmadd_ps(x2b, cb, _mm256_mul_ps(x1b, sb));
        store_vec<kStream>(VecH(narrow_bf16_lanes(y1a, y1b)), out + p);
        store_vec<kStream>(VecH(narrow_bf16_lanes(y2a, y2b)), out + half + p);
      }
    }
#endif
    for (; p + W <= half; p += W) {
      auto [x1a, x1b] = at::vec::convert_to_float<scalar_t>(VecH::loadu(in + p));
      auto [x2a, x2b] = at::vec::convert_to_float<scalar_t>(VecH::loadu(in + half + p));
      VecF y1a, y2a, y1b, y2b;
      rotate(x1a, x2a, p, y1a, y2a);
      rotate(x1b, x2b, p + F, y1b, y2b);
      store_vec<kStream>(at::vec::convert_from_float<scalar_t>(y1a, y1b), out + p);
      store_vec<kStream>(at::vec::convert_from_float<scalar_t>(y2a, y2b), out + half + p);
    }
  } else {  // W elements (W / 2 pairs) per load, rotated as they lie (rotate_paired_vec)
    for (; p + W / 2 <= half; p += W / 2) {
      auto [xa, xb] = at::vec::convert_to_float<scalar_t>(VecH::loadu(in + 2 * p));
      const VecF ya = rotate_paired_vec(xa, VecF::loadu(t.cs2 + 2 * p), VecF::loadu(t.sn2 + 2 * p));
      const VecF yb = rotate_paired_vec(xb, VecF::loadu(t.cs2 + 2 * p + F), VecF::loadu(t.sn2 + 2 * p + F));
      store_vec<kStream>(at::vec::convert_from_float<scalar_t>(ya, yb), out + 2 * p);
    }
  }
  if (p < half) rotate_row_strided<scalar_t, float>(a, in, 1, out, 1, t, p);
}

// One row; `stream` (the call writes kStreamBytes or more) asks for streaming stores where
// the row allows them (out of place: row_streams; contiguous and aligned: rows_can_stream),
// plain stores elsewhere.
template <typename scalar_t, typename acc_t>
POSENC_ROW_INLINE void rotate_row(const RopeArgs& a, const scalar_t* in, int64_t si, scalar_t* out, int64_t so,
                const TokenAngles<acc_t>& t, bool stream = false) {
  // The rotary features [begin, begin + rotary_dim) rotate (math::rope_rotary_begin).
  const int64_t begin = math::rope_rotary_begin(a.settings);
  const scalar_t* rin = in + begin * si;
  scalar_t* rout = out + begin * so;
  const bool nt = row_streams(stream, in, out) && si == 1 && so == 1 &&
                  rows_can_stream<scalar_t>(rout, a.rotary_dim);
  if (si != 1 || so != 1) {
    rotate_row_strided<scalar_t, acc_t>(a, rin, si, rout, so, t, 0);
  } else if constexpr (std::is_same_v<scalar_t, acc_t>) {
    nt ? rotate_row_vec<scalar_t, true>(a, rin, rout, t)
       : rotate_row_vec<scalar_t>(a, rin, rout, t);
  } else {
    nt ? rotate_row_vec_reduced<scalar_t, true>(a, rin, rout, t)
       : rotate_row_vec_reduced<scalar_t>(a, rin, rout, t);
  }
  if (in != out && si == 1 && so == 1) {  // the other features pass through: two runs,
    // streamed as the rotated ones are (a plain store would first read the line it fills)
    const int64_t end = begin + a.rotary_dim;
    for (const auto& [from, n] : {std::pair<int64_t, int64_t>{0, begin}, {end, a.head_dim - end}}) {
      if (n == 0) continue;
      if (nt && row_can_stream<scalar_t>(out + from, n)) {
        stream_row(in + from, out + from, n);
      } else {
        std::memcpy(out + from, in + from, static_cast<size_t>(n) * sizeof(scalar_t));
      }
    }
  } else if (in != out) {
    for (int64_t j = 0; j < a.head_dim - a.rotary_dim; ++j) {
      const int64_t e = math::rope_pass_feature(j, begin, a.rotary_dim);
      out[e * so] = in[e * si];
    }
  }
}

// n half-precision values widened to float32 (exact), vector by vector (ATen's convert()
// from Half is a scalar loop).
template <typename scalar_t>
inline void widen(const scalar_t* x, float* xf, int64_t n) {
  using VecH = at::vec::Vectorized<scalar_t>;
  using VecF = at::vec::Vectorized<float>;
  int64_t i = 0;
  for (; i + VecH::size() <= n; i += VecH::size()) {
    auto [lo, hi] = at::vec::convert_to_float<scalar_t>(VecH::loadu(x + i));
    lo.store(xf + i);
    hi.store(xf + i + VecF::size());
  }
  for (; i < n; ++i) xf[i] = static_cast<float>(x[i]);
}

template <typename scalar_t>
void nan_row(const RopeArgs& a, scalar_t* out, int64_t so) {
  for (int64_t j = 0; j < a.head_dim; ++j) {
    out[j * so] = std::numeric_limits<scalar_t>::quiet_NaN();
  }
}

POSENC_ISA_NAMESPACE_END
}  // namespace cpu
}  // namespace ops
}  // namespace posenc
