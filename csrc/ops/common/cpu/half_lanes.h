// float32 <-> bfloat16 in the AVX2 kernels' vector paths, with ATen's bits: the one place
// that rounds float32 to bfloat16 in a 256- or 512-bit register outside ATen's own conversions
// (RoPE's and qk_norm_rope's rows of split halves, add_position's bfloat16 paths,
// sinusoidal_table's AVX2 and AVX-512 sweeps). Only for
// the vector-ISA translation units (POSENC_ISA_SOURCES): every function lives in the ISA
// namespace (posenc/math/host_device.h).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "ops/common/cpu/cpu_capability.h"
#include "ops/common/cpu/cpu_support.h"  // kStreamBytes
#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN

// stream_fence() must follow a thread's last streaming store (of a call that writes
// kStreamBytes or more: cpu_support.h) before its work is handed back.
inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
// bfloat16 -> float32 in the lane order of AVX2's in-lane unpack: 16 values widen to
// (elements 0-3, 8-11) and (4-7, 12-15) in two instructions (ATen's cvtbf16_fp32 crosses
// lanes: five), and narrow_bf16_lanes restores the order: only what meets in a lane must
// share the order (rope_rows.h fill_pair_angles orders the angles so).
inline void widen_bf16_lanes(const c10::BFloat16* x, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

// ATen's rounding of the 8 lanes of v without its NaN blend: the bfloat16 bits in the low 16
// bits of each 32-bit lane (a NaN lane's are not ATen's 0xffff).
inline __m256i bf16_round_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)), u), 16);
}

// 16 float32 values (lo, hi in the lane order of widen_bf16_lanes) rounded to bfloat16 as
// ATen rounds them, back in element order.
inline __m256i narrow_bf16_lanes(__m256 lo, __m256 hi) {
  __m256i rlo = bf16_round_bits(lo), rhi = bf16_round_bits(hi);
  const __m256 nan = _mm256_cmp_ps(lo, hi, _CMP_UNORD_Q);
  if (!_mm256_testz_ps(nan, nan)) {
    const __m256i nan_bits = _mm256_set1_epi32(0xffff);
    rlo = _mm256_blendv_epi8(nan_bits, rlo, _mm256_castps_si256(_mm256_cmp_ps(lo, lo, _CMP_ORD_Q)));
    rhi = _mm256_blendv_epi8(nan_bits, rhi, _mm256_castps_si256(_mm256_cmp_ps(hi, hi, _CMP_ORD_Q)));
  }
  return _mm256_packus_epi32(rlo, rhi);
}

#if defined(__GNUC__) || defined(__clang__)
// The same rounding 512 bits wide, for the AVX-512 paths compiled by target attribute in the
// AVX2 build (called only where cpu_capability() is avx512): bf16_round_bits of 16 lanes
// (no NaN blend), and narrow_bf16_512, 16 float32 values in element order to bfloat16 as
// ATen rounds them (NaN -> 0xffff). POSENC_AVX512_TARGET: the attribute of every such path.
#define POSENC_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
// Around the AVX-512 paths of a kernel file: GCC 12's avx512fintrin.h builds set1/setr and the
// zero-extending loads from a self-initialised vector and then warns about it under
// -Wuninitialized; nothing there reads an uninitialised value.
#if defined(__GNUC__) && !defined(__clang__)
#define POSENC_AVX512_WARNINGS_BEGIN                                                     \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define POSENC_AVX512_WARNINGS_END _Pragma("GCC diagnostic pop")
#else
#define POSENC_AVX512_WARNINGS_BEGIN
#define POSENC_AVX512_WARNINGS_END
#endif

POSENC_AVX512_TARGET inline __m512i bf16_round_bits_512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)), u), 16);
}

POSENC_AVX512_TARGET inline __m256i narrow_bf16_512(__m512 v) {
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(bf16_round_bits_512(v), nan, _mm512_set1_epi32(0xffff)));
}

// 16 values widened to float32 in element order, and narrowed back as ATen rounds (float16:
// vcvtps2ph to nearest even, as cvtfp32_fp16; bfloat16: narrow_bf16_512).
template <typename T>
POSENC_AVX512_TARGET __attribute__((always_inline)) inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, c10::Half>) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// The 16 half-precision values of v (T bfloat16 or float16), as ATen rounds them.
template <typename T>
POSENC_AVX512_TARGET __attribute__((always_inline)) inline __m256i narrow16(__m512 v) {
  static_assert(std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>, "half precision only");
  if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    return narrow_bf16_512(v);
  }
}

template <typename T>
POSENC_AVX512_TARGET __attribute__((always_inline)) inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow16<T>(v));
  }
}

// acc + v's lanes 0-7, then + its lanes 8-15: a sum over 8 lanes (qk_norm_rows.h kLanes) in
// its order, fed 16 lanes at a time.
POSENC_AVX512_TARGET __attribute__((always_inline)) inline __m256 add8(__m256 acc, __m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(v)), hi);
}

// AVX-512F/BW/VL present and not capped by POSENC_CPU_CAPABILITY (cpu_capability.h): where the
// AVX2 kernels take their AVX-512 paths.
inline bool cpu_has_avx512() {
  static const bool has = cpu_capability() == CpuCapability::kAvx512;
  return has;
}
#endif
#endif

POSENC_ISA_NAMESPACE_END
}  // namespace cpu
}  // namespace ops
}  // namespace posenc
