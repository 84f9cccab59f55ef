// CPU kernel of rope_append_kv. Tokens are spread over threads (at::parallel_for); each
// token's cos/sin are computed once (rope_rows.h, RoPE's own pieces) and serve every head of
// q and k: q rotated into its output, k rotated straight into its cache row (and into the
// returned k when asked), v copied into its cache row. One read of q, k, v; one write of q and
// of each cache row.
#include "ops/rope_append_kv/cpu/kernel.h"

#include <ATen/Parallel.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "ops/common/cpu/rope_rows.h"
#include "ops/common/cpu/qk_norm_rows.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace {

// v's row into its cache row; with `stream`, streaming stores where the rows allow them
// (rope_rows.h: row_streams, rows_can_stream).
template <typename scalar_t>
void copy_row(const scalar_t* in, int64_t si, scalar_t* out, int64_t so, int64_t n, bool stream) {
  if (si != 1 || so != 1) {
    for (int64_t j = 0; j < n; ++j) out[j * so] = in[j * si];
    return;
  }
  // A row of n elements as a "rotary_dim" of 2n: its start aligned and n * sizeof a multiple
  // of 32 bytes, so the loop below covers the row in whole vectors.
  if (row_streams(stream, in, out) && rows_can_stream<scalar_t>(out, 2 * n)) {
    using Vec = Vectorized<scalar_t>;
    for (int64_t j = 0; j < n; j += Vec::size()) store_vec<true>(Vec::loadu(in + j), out + j);
    return;
  }
  std::memcpy(out, in, n * sizeof(scalar_t));
}

// A float32 staging row of n elements (the FP8 path), from c10's CPU allocator: a
// std::vector's out-of-line members would be weak symbols this ISA build shares with the
// baseline one (tests/cpp/check_isa_symbols.sh).
struct StagingRow {
  explicit StagingRow(int64_t n)
      : p(n > 0 ? static_cast<float*>(c10::alloc_cpu(static_cast<size_t>(n) * sizeof(float))) : nullptr) {}
  ~StagingRow() { c10::free_cpu(p); }
  StagingRow(const StagingRow&) = delete;
  StagingRow& operator=(const StagingRow&) = delete;
  float* data() const { return p; }
  float* p;
};

#if defined(CPU_CAPABILITY_AVX2)
// The float32 -> FP8 rounding's constants on a float32's bits (e4m3fn or e5m2), c10's, for
// quantize8 and quantize_avx512: the mantissa bits dropped, the smallest normal FP8 value
// (below it, subnormals), the magic number whose float addition rounds a subnormal, and the
// exponent rebias plus the round-to-nearest-even half.
template <bool kE4M3>
struct Fp8Bits {
  static constexpr int kShift = kE4M3 ? 20 : 21;
  static constexpr uint32_t kNormalMin = (kE4M3 ? 121u : 113u) << 23;
  static constexpr uint32_t kDenormMask = (kE4M3 ? 141u : 134u) << 23;
  static constexpr uint32_t kBias = (kE4M3 ? (uint32_t)(7 - 127) << 23 : (uint32_t)(15 - 127) << 23) +
                                    (kE4M3 ? 0x7FFFFu : 0xFFFFFu);
};

// kv_quantize on 8 lanes, c10's conversion step by step: the division and the saturation as
// IEEE vector operations, the rounding as exact integer arithmetic on the bits (one float
// addition for subnormals, as c10's), so the same bits as the scalar form. NaN lanes give
// c10's NaN (0x7F) with their sign.
template <bool kE4M3>
inline __m128i quantize8_bytes(const float* in, __m256 scale) {
  using B = Fp8Bits<kE4M3>;
  constexpr int kShift = B::kShift;
  constexpr uint32_t kNormalMin = B::kNormalMin, kDenormMask = B::kDenormMask, kBias = B::kBias;
  const __m256 y = _mm256_div_ps(_mm256_loadu_ps(in), scale);
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256 mag = _mm256_min_ps(_mm256_castsi256_ps(_mm256_xor_si256(bits, sign)),
                                   _mm256_set1_ps(kv_format_max(kE4M3 ? KvCacheFormat::kFloat8E4M3 : KvCacheFormat::kFloat8E5M2)));  // saturate
  const __m256i a = _mm256_castps_si256(mag);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>(kBias))), odd), kShift);
  const __m256i denorm_mask = _mm256_set1_epi32(static_cast<int>(kDenormMask));
  const __m256i subnormal = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(mag, _mm256_castsi256_ps(denorm_mask))), denorm_mask);
  __m256i r = _mm256_blendv_epi8(
      normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(kNormalMin)), a));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
  r = _mm256_or_si256(_mm256_and_si256(r, _mm256_set1_epi32(0xFF)), _mm256_srli_epi32(sign, 24));
  // The low byte of each lane: bytes 0, 4, 8, 12 of each 128-bit half, then the halves' words.
  const __m256i low = _mm256_shuffle_epi8(
      r, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1,
                          -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i packed = _mm256_permutevar8x32_epi32(low, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  return _mm256_castsi256_si128(packed);  // the 8 bytes in the low half
}

template <bool kE4M3>
inline void quantize8(const float* in, uint8_t* out, __m256 scale) {
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), quantize8_bytes<kE4M3>(in, scale));
}

// 32 values into 32 bytes at a 32-byte aligned `out` with one streaming store (stream_fence
// after the last): the bits of quantize8's.
template <bool kE4M3>
inline void quantize32_stream(const float* in, uint8_t* out, __m256 scale) {
  const __m128i lo = _mm_unpacklo_epi64(quantize8_bytes<kE4M3>(in, scale), quantize8_bytes<kE4M3>(in + 8, scale));
  const __m128i hi = _mm_unpacklo_epi64(quantize8_bytes<kE4M3>(in + 16, scale), quantize8_bytes<kE4M3>(in + 24, scale));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(out), _mm256_set_m128i(hi, lo));
}
#endif

#if defined(CPU_CAPABILITY_AVX2) && (defined(__GNUC__) || defined(__clang__))
POSENC_AVX512_WARNINGS_BEGIN
// quantize8 on 16 lanes for CPUs with AVX-512 (compiled by target attribute, called where
// cpu_has_avx512()): the same steps, the blends as mask moves, the low bytes packed by one
// truncating narrow (every lane holds a byte); the same bits: the 16 bytes.
template <bool kE4M3>
POSENC_AVX512_TARGET __attribute__((always_inline)) inline __m128i quantize16_bytes(const float* in, __m512 scale) {
  using B = Fp8Bits<kE4M3>;
  constexpr int kShift = B::kShift;
  constexpr uint32_t kNormalMin = B::kNormalMin, kDenormMask = B::kDenormMask, kBias = B::kBias;
  const __m512 most = _mm512_set1_ps(kv_format_max(kE4M3 ? KvCacheFormat::kFloat8E4M3 : KvCacheFormat::kFloat8E5M2));
  const __m512i denorm_mask = _mm512_set1_epi32(static_cast<int>(kDenormMask));
  const __m512 y = _mm512_div_ps(_mm512_loadu_ps(in), scale);
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN));
  const __m512 mag = _mm512_min_ps(_mm512_castsi512_ps(_mm512_xor_si512(bits, sign)), most);  // saturate
  const __m512i a = _mm512_castps_si512(mag);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, kShift), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>(kBias))), odd), kShift);
  const __m512i subnormal =
      _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(mag, _mm512_castsi512_ps(denorm_mask))), denorm_mask);
  __m512i r = _mm512_mask_mov_epi32(normal, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(kNormalMin)), a),
                                    subnormal);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));
  r = _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0xFF)), _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(r);
}

// n values quantised into `out`, 16 at a time; with `stream` and a 64-byte aligned `out`,
// whole cache lines of 64 values by one streaming store each (a large call's cache rows: a
// plain store first reads the line it overwrites; bfloat16 prefill (1, 2048, 32, 8, 128) into
// e4m3 caches: benchmarks/NOTES.md). Returns the values done.
template <bool kE4M3>
POSENC_AVX512_TARGET int64_t quantize_avx512(const float* in, uint8_t* out, int64_t n, float scale_value, bool stream) {
  const __m512 scale = _mm512_set1_ps(scale_value);
  int64_t j = 0;
  if (stream && reinterpret_cast<std::uintptr_t>(out) % 64 == 0) {
    for (; j + 64 <= n; j += 64) {
      __m512i line = _mm512_castsi128_si512(quantize16_bytes<kE4M3>(in + j, scale));
      line = _mm512_inserti32x4(line, quantize16_bytes<kE4M3>(in + j + 16, scale), 1);
      line = _mm512_inserti32x4(line, quantize16_bytes<kE4M3>(in + j + 32, scale), 2);
      line = _mm512_inserti32x4(line, quantize16_bytes<kE4M3>(in + j + 48, scale), 3);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + j), line);
    }
  }
  for (; j + 16 <= n; j += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), quantize16_bytes<kE4M3>(in + j, scale));
  }
  return j;
}
POSENC_AVX512_WARNINGS_END
#endif

// FP8 caches: n float32 values quantised into a cache row (element stride so); `stream`: a
// large call's row, whose whole aligned lines may take streaming stores (stream_fence after
// the last).
void quantize_row(const float* in, uint8_t* out, int64_t so, int64_t n, KvCacheFormat f, float scale,
                  bool stream = false) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if (so == 1) {
    const bool e4m3 = f == KvCacheFormat::kFloat8E4M3;
#if defined(__GNUC__) || defined(__clang__)
    if (cpu_has_avx512()) {
      j = e4m3 ? quantize_avx512<true>(in, out, n, scale, stream) : quantize_avx512<false>(in, out, n, scale, stream);
    }
#endif
    const __m256 s = _mm256_set1_ps(scale);
    if (j == 0 && stream && reinterpret_cast<std::uintptr_t>(out) % 32 == 0) {
      for (; j + 32 <= n; j += 32) {
        e4m3 ? quantize32_stream<true>(in + j, out + j, s) : quantize32_stream<false>(in + j, out + j, s);
      }
    }
    if (e4m3) {
      for (; j + 8 <= n; j += 8) quantize8<true>(in + j, out + j, s);
    } else {
      for (; j + 8 <= n; j += 8) quantize8<false>(in + j, out + j, s);
    }
  }
#endif
  for (; j < n; ++j) out[j * so] = kv_quantize(f, in[j], scale);
}

// A row widened to float32 (exact), for the FP8 path.
template <typename scalar_t>
const float* widen_row(const scalar_t* in, int64_t si, float* out, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (si == 1) return in;
  } else {
    if (si == 1) {
      widen(in, out, n);
      return out;
    }
  }
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(in[j * si]);
  return out;
}

// qk_norm_rope's parameters for the norm rows (qk_norm_rows.h) of a call with QK-norm.
inline QkNormRopeArgs qk_norm_args(const KvCacheArgs& a) {
  QkNormRopeArgs na;
  na.rope = a.rope;
  na.q_weight = a.q_weight;
  na.k_weight = a.k_weight;
  na.eps = a.eps;
  na.norm = a.norm;
  return na;
}

// forward_operand (qk_norm_rows.h) over one token's heads of `op`, its rows at in / out with the
// heads' and features' strides of `op` (b and s already applied): contiguous rows take the
// vector paths; `stream` as forward_row's.
template <typename scalar_t, typename acc_t>
void norm_rotate_heads(const QkNormRopeArgs& na, const RopeOperand& op, const void* in,
                       const int64_t* in_stride, void* out, const int64_t* out_stride,
                       const acc_t* w, const TokenAngles<acc_t>& angles, bool stream = false) {
  RopeOperand t;
  t.heads = op.heads;
  t.in = in;
  t.out = out;
  t.in_stride[2] = in_stride[2];
  t.in_stride[3] = in_stride[3];
  t.out_stride[2] = out_stride[2];
  t.out_stride[3] = out_stride[3];
  if (t.in_stride[3] == 1 && t.out_stride[3] == 1) {
    qk_norm_rows::forward_operand<scalar_t, acc_t, true>(na, t, w, 0, 0, angles, stream);
  } else {
    qk_norm_rows::forward_operand<scalar_t, acc_t, false>(na, t, w, 0, 0, angles);
  }
}

// One token of a call with QK-norm: q normalised and rotated into its output; k normalised
// and rotated into its cache row (an FP8 cache: from a float32 copy of the token's k heads,
// as qk_norm_rope on float32 k, then quantised) and into the returned k when asked; q's rows
// and same-dtype cache rows with streaming stores in a large call (`stream`, as the plain path).
template <typename scalar_t, typename acc_t>
void normed_token(const KvCacheArgs& a, const QkNormRopeArgs& na, int64_t b, int64_t s, bool cached,
                  int64_t outer, int64_t inner, const TokenAngles<acc_t>& angles, float* stage_in,
                  float* stage_out, bool stream) {
  const RopeArgs& r = a.rope;
  const auto* wq = static_cast<const acc_t*>(a.q_weight);
  const auto* wk = static_cast<const acc_t*>(a.k_weight);
  const auto token = [b, s](const void* base, const int64_t* st) {
    return static_cast<const scalar_t*>(base) + b * st[0] + s * st[1];
  };
  const auto token_out = [b, s](void* base, const int64_t* st) {
    return static_cast<scalar_t*>(base) + b * st[0] + s * st[1];
  };
  norm_rotate_heads<scalar_t, acc_t>(na, r.q, token(r.q.in, r.q.in_stride), r.q.in_stride,
                                     token_out(r.q.out, r.q.out_stride), r.q.out_stride, wq, angles, stream);
  const scalar_t* k_token = token(r.k.in, r.k.in_stride);
  const int64_t* sc = a.k_cache_stride;
  if (cached && a.k_format != KvCacheFormat::kSame) {
    if constexpr (std::is_same_v<acc_t, float>) {
      const int64_t D = r.head_dim;
      for (int64_t h = 0; h < r.k.heads; ++h) {
        const float* wide = widen_row(k_token + h * r.k.in_stride[2], r.k.in_stride[3], stage_in + h * D, D);
        if (wide != stage_in + h * D) std::memcpy(stage_in + h * D, wide, D * sizeof(float));
      }
      const int64_t dense[4] = {0, 0, D, 1};
      norm_rotate_heads<float, float>(na, r.k, stage_in, dense, stage_out, dense, wk, angles);
      for (int64_t h = 0; h < r.k.heads; ++h) {
        quantize_row(stage_out + h * D,
                     static_cast<uint8_t*>(a.k_cache) + outer * sc[0] + inner * sc[1] + h * sc[2], sc[3], D,
                     a.k_format, a.k_scale, stream);
      }
    }
  } else if (cached) {
    norm_rotate_heads<scalar_t, acc_t>(na, r.k, k_token, r.k.in_stride,
                                       static_cast<scalar_t*>(a.k_cache) + outer * sc[0] + inner * sc[1],
                                       sc, wk, angles, stream);
  }
  if (a.write_k) {
    norm_rotate_heads<scalar_t, acc_t>(na, r.k, k_token, r.k.in_stride,
                                       token_out(r.k.out, r.k.out_stride), r.k.out_stride, wk, angles);
  }
}

template <typename scalar_t>
void rope_append_kv_tokens(const KvCacheArgs& a) {
  using acc_t = at::opmath_type<scalar_t>;
  const RopeArgs& r = a.rope;
  const int64_t row_elems =
      std::max<int64_t>(1, (r.q.heads + 2 * r.k.heads) * std::max(r.head_dim, a.v_head_dim));
  // About 64k elements per task: a decode step (a few tokens) runs on the calling thread,
  // where waking the pool would cost more than the work.
  const int64_t grain = std::max<int64_t>(1, 65536 / row_elems);
  const auto* q_in = static_cast<const scalar_t*>(r.q.in);
  auto* q_out = static_cast<scalar_t*>(r.q.out);
  const auto* k_in = static_cast<const scalar_t*>(r.k.in);
  auto* k_out = static_cast<scalar_t*>(r.k.out);
  const auto* v_in = static_cast<const scalar_t*>(a.v);
  auto* kc = static_cast<scalar_t*>(a.k_cache);
  auto* vc = static_cast<scalar_t*>(a.v_cache);
  // FP8 caches (k of float32, bfloat16 or float16, so acc_t is float): a row is rotated in
  // float32 into a staging row, as a float32 k's row would be, then quantised into the cache.
  constexpr bool kCanQuantize = std::is_same_v<acc_t, float>;
  const bool k_fp8 = a.k_format != KvCacheFormat::kSame;
  const bool v_fp8 = a.v_format != KvCacheFormat::kSame;
  // QK-norm: qk_norm_rope's forward rows (qk_norm_rows.h) on q, and on k into its cache row.
  const bool normed = a.q_weight != nullptr;
  const QkNormRopeArgs na = qk_norm_args(a);

  const int64_t tokens = r.batch * r.seq;
  const int64_t written = tokens * static_cast<int64_t>(sizeof(scalar_t)) *
                          (r.q.heads * r.head_dim + r.k.heads * (r.head_dim + a.v_head_dim));
  // A large call streams its cache rows; q's rows only out of place (rotate_row asks
  // row_streams: in place, q's lines were just loaded).
  const bool stream = written >= kStreamBytes;
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    TokenAngles<acc_t> angles;
    int64_t pos[math::kRopeMaxAxes];
    // Staging of the FP8 path: the widened input, the rotated row (with QK-norm: all of the
    // token's k heads, which norm "hidden" normalises together).
    const bool fp8 = k_fp8 || v_fp8;
    const int64_t k_row_elems = normed ? r.k.heads * r.head_dim : r.head_dim;
    const StagingRow stage_in(fp8 ? std::max(k_row_elems, a.v_head_dim) : 0);
    const StagingRow stage_out(k_fp8 ? k_row_elems : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / r.seq, s = item % r.seq;
      token_positions(r, b, s, pos);  // no packed sequences here: always a position
      token_angles<acc_t>(r, pos, angles);
      int64_t outer = 0, inner = 0;
      const bool cached = kv_cache_row(a, b, s, &outer, &inner);
      if (normed) {
        normed_token<scalar_t, acc_t>(a, na, b, s, cached, outer, inner, angles, stage_in.data(),
                                      stage_out.data(), stream);
      } else {
        const bool q_gaps = rows_have_gaps(r.q.in_stride[2], r.q.in_stride[3], r.head_dim);
        for (int64_t h = 0; h < r.q.heads; ++h) {
          const int64_t* si = r.q.in_stride;
          const int64_t* so = r.q.out_stride;
          if (q_gaps) prefetch_row_ahead(q_in + b * si[0] + s * si[1] + h * si[2], si[2], r.head_dim, q_in == q_out);
          rotate_row<scalar_t, acc_t>(r, q_in + b * si[0] + s * si[1] + h * si[2], si[3],
                                      q_out + b * so[0] + s * so[1] + h * so[2], so[3], angles,
                                      stream);
        }
        for (int64_t h = 0; h < r.k.heads; ++h) {
          const int64_t* si = r.k.in_stride;
          const scalar_t* k_row = k_in + b * si[0] + s * si[1] + h * si[2];
          const int64_t* sc = a.k_cache_stride;
          const int64_t k_at = outer * sc[0] + inner * sc[1] + h * sc[2];
          if (cached && k_fp8) {
            if constexpr (kCanQuantize) {
              const float* wide = widen_row(k_row, si[3], stage_in.data(), r.head_dim);
              rotate_row<float, float>(r, wide, 1, stage_out.data(), 1, angles);
              quantize_row(stage_out.data(), static_cast<uint8_t*>(a.k_cache) + k_at, sc[3],
                           r.head_dim, a.k_format, a.k_scale, stream);
            }
          } else if (cached) {
            rotate_row<scalar_t, acc_t>(r, k_row, si[3], kc + k_at, sc[3], angles, stream);
          }
          if (a.write_k) {
            const int64_t* so = r.k.out_stride;
            rotate_row<scalar_t, acc_t>(r, k_row, si[3], k_out + b * so[0] + s * so[1] + h * so[2],
                                        so[3], angles);
          }
        }
      }
      for (int64_t h = 0; cached && h < r.k.heads; ++h) {
        const int64_t* sv = a.v_stride;
        const int64_t* svc = a.v_cache_stride;
        const scalar_t* v_row = v_in + b * sv[0] + s * sv[1] + h * sv[2];
        const int64_t v_at = outer * svc[0] + inner * svc[1] + h * svc[2];
        if (v_fp8) {
          if constexpr (kCanQuantize) {
            quantize_row(widen_row(v_row, sv[3], stage_in.data(), a.v_head_dim),
                         static_cast<uint8_t*>(a.v_cache) + v_at, svc[3], a.v_head_dim, a.v_format,
                         a.v_scale, stream);
          }
        } else {
          copy_row(v_row, sv[3], vc + v_at, svc[3], a.v_head_dim, stream);
        }
      }
    }
    if (stream) stream_fence();  // before this thread's part is handed back
  });
}

void rope_append_kv_kernel(const KvCacheArgs& a, c10::ScalarType dtype) {
  dispatch_floating(dtype, "posenc_rope_append_kv_cpu", [&](auto* tag) {
    rope_append_kv_tokens<std::remove_pointer_t<decltype(tag)>>(a);
  });
}

}  // namespace
POSENC_ISA_NAMESPACE_END

POSENC_REGISTER_DISPATCH(rope_append_kv_stub, &rope_append_kv_kernel)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
