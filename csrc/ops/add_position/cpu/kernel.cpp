// CPU kernels of add_position: one pass over x that adds the table rows and applies the
// dropout mask. Rows are spread over threads with at::parallel_for; within a row, the
// Philox rounds run over 8 counters at a time (SIMD lanes) and the add/scale uses at::vec;
// on CPUs with AVX-512, over 4 x 16 counters, and the mask applied from the registers
// (dropout_fused_avx512).
// The bits are those of the shared header posenc/math/philox.h, so CPU and CUDA agree.
#include "ops/add_position/cpu/kernel.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "ops/common/cpu/half_lanes.h"
#include "posenc/math/philox.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace {

using at::vec::Vectorized;

// Elements per chunk: keep factors and random bits of a chunk stay in L1.
constexpr int64_t kChunk = 1024;
constexpr int kLanes = 8;  // Philox counters processed together

// Stores the 16 random bits of the element lanes of 8 blocks: block i's bits are its four
// Philox words (c0[i], c1[i], c2[i], c3[i]), low half first, i.e. dropout_lane_bits order.
void store_block_bits(const uint32_t (&c0)[kLanes], const uint32_t (&c1)[kLanes],
                      const uint32_t (&c2)[kLanes], const uint32_t (&c3)[kLanes], int64_t lanes,
                      uint16_t* bits) {
  for (int64_t i = 0; i < lanes; ++i) {
    const uint32_t words[4] = {c0[i], c1[i], c2[i], c3[i]};
    uint16_t* out = bits + i * math::kDropoutBlock;
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = static_cast<uint16_t>(words[w]);
      out[2 * w + 1] = static_cast<uint16_t>(words[w] >> 16);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// (hi, lo) halves of the 32x32 -> 64-bit products of 8 lanes with a constant.
inline void mulhilo8(__m256i c, __m256i mul, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(c, mul);                         // lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), mul);  // lanes 1, 3, 5, 7
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// The ten round keys of a seed, broadcast to 8 lanes: built once per call of the fused path
// instead of per round of every group (measured: benchmarks/NOTES.md, CPU item 13).
struct PhiloxKeys8 {
  __m256i k0[math::kPhiloxRounds], k1[math::kPhiloxRounds];
  explicit PhiloxKeys8(uint64_t seed) {
    uint32_t a = static_cast<uint32_t>(seed), b = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < math::kPhiloxRounds; ++round) {
      k0[round] = _mm256_set1_epi32(static_cast<int>(a));
      k1[round] = _mm256_set1_epi32(static_cast<int>(b));
      a += math::kPhiloxWeyl0;
      b += math::kPhiloxWeyl1;
    }
  }
};

// Ten rounds of philox4x32_10 (posenc/math/philox.h: same rounds and constants) on the 8
// counters (v[g][0..3])[lane] of each of kGroups groups at once: the groups are independent
// chains the core overlaps (a standalone loop on the Zen 4 host, 1 thread: 0.35 ns per
// element for one group, 0.27 for two, 0.25 for three or four).
template <int kGroups>
inline void philox8_rounds(const PhiloxKeys8& keys, __m256i (&v)[kGroups][4]) {
  const __m256i mul0 = _mm256_set1_epi32(static_cast<int>(math::kPhiloxMul0));
  const __m256i mul1 = _mm256_set1_epi32(static_cast<int>(math::kPhiloxMul1));
  for (int round = 0; round < math::kPhiloxRounds; ++round) {
    for (int g = 0; g < kGroups; ++g) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(v[g][0], mul0, hi0, lo0);
      mulhilo8(v[g][2], mul1, hi1, lo1);
      v[g][0] = _mm256_xor_si256(_mm256_xor_si256(hi1, v[g][1]), keys.k0[round]);
      v[g][1] = lo1;
      v[g][2] = _mm256_xor_si256(_mm256_xor_si256(hi0, v[g][3]), keys.k1[round]);
      v[g][3] = lo0;
    }
  }
}

// The counters of 8 consecutive blocks from block0, whose indices share their high word
// (dropout_counter's layout: offset/4 lo/hi, block lo/hi).
inline void philox8_counters(uint64_t offset, uint64_t block0, __m256i& v0, __m256i& v1,
                             __m256i& v2, __m256i& v3) {
  v0 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 2)));
  v1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 34)));
  v2 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0))),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  v3 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0 >> 32)));
}

// 4 x 8 transpose of 32-bit words, rows v0..v3 (one per word) to block order: words[k]
// holds blocks 2k and 2k + 1, i.e. the 16-bit values of elements 16 k .. 16 k + 15 of the
// 8 blocks in element order (dropout_lane_bits order on little-endian x86).
inline void philox8_transpose(__m256i v0, __m256i v1, __m256i v2, __m256i v3,
                              __m256i (&words)[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(v0, v1), t1 = _mm256_unpackhi_epi32(v0, v1);
  const __m256i t2 = _mm256_unpacklo_epi32(v2, v3), t3 = _mm256_unpackhi_epi32(v2, v3);
  const __m256i b04 = _mm256_unpacklo_epi64(t0, t2), b15 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i b26 = _mm256_unpacklo_epi64(t1, t3), b37 = _mm256_unpackhi_epi64(t1, t3);
  words[0] = _mm256_permute2x128_si256(b04, b15, 0x20);
  words[1] = _mm256_permute2x128_si256(b26, b37, 0x20);
  words[2] = _mm256_permute2x128_si256(b04, b15, 0x31);
  words[3] = _mm256_permute2x128_si256(b26, b37, 0x31);
}

// philox4x32_10 on 8 counters at once; writes the 8 blocks' bits in element order: block
// i's words (c0, c1, c2, c3)[i] at bits + 8 * i, which on little-endian x86 is
// dropout_lane_bits order.
void philox8_bits(uint64_t seed, uint64_t offset, uint64_t block0, int64_t lanes,
                  uint16_t* bits) {
  alignas(32) uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  __m256i v[1][4];
  if (static_cast<uint32_t>(block0) <= 0xFFFFFFFFu - kLanes) {
    // The usual case: the 8 block indices share their high word.
    philox8_counters(offset, block0, v[0][0], v[0][1], v[0][2], v[0][3]);
  } else {
    for (int i = 0; i < kLanes; ++i) math::dropout_counter(offset, block0 + i, c0[i], c1[i], c2[i], c3[i]);
    v[0][0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c0));
    v[0][1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c1));
    v[0][2] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c2));
    v[0][3] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c3));
  }
  philox8_rounds(PhiloxKeys8(seed), v);
  if (lanes == kLanes) {
    __m256i words[4];
    philox8_transpose(v[0][0], v[0][1], v[0][2], v[0][3], words);
    __m256i* out = reinterpret_cast<__m256i*>(bits);
    for (int k = 0; k < 4; ++k) _mm256_storeu_si256(out + k, words[k]);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c0), v[0][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c1), v[0][1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c2), v[0][2]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c3), v[0][3]);
    store_block_bits(c0, c1, c2, c3, lanes, bits);
  }
}

// The bits of kGroups groups of 8 whole blocks from block0, whose indices share their high
// word: counters, the rounds of the groups as independent chains (philox8_rounds), then each
// group's words in element order (words[g][k]: elements 16 k .. 16 k + 15 of group g's 64,
// dropout_lane_bits order). The one AVX2 walk of philox8_bits2 and philox8_pieces.
template <int kGroups>
inline void philox8_groups(const PhiloxKeys8& keys, uint64_t offset, uint64_t block0,
                           __m256i (&words)[kGroups][4]) {
  __m256i v[kGroups][4];
  for (int g = 0; g < kGroups; ++g) {
    philox8_counters(offset, block0 + kLanes * g, v[g][0], v[g][1], v[g][2], v[g][3]);
  }
  philox8_rounds(keys, v);
  for (int g = 0; g < kGroups; ++g) philox8_transpose(v[g][0], v[g][1], v[g][2], v[g][3], words[g]);
}

// philox8_bits for 16 whole blocks whose indices share their high word, as two groups at once.
void philox8_bits2(const PhiloxKeys8& keys, uint64_t offset, uint64_t block0, uint16_t* bits) {
  __m256i words[2][4];
  philox8_groups<2>(keys, offset, block0, words);
  for (int g = 0; g < 2; ++g) {
    __m256i* out = reinterpret_cast<__m256i*>(bits + g * kLanes * math::kDropoutBlock);
    for (int k = 0; k < 4; ++k) _mm256_storeu_si256(out + k, words[g][k]);
  }
}

// The AVX2 Philox walk of the one-pass dropout paths: for elements [first, first + done) of
// the call (first a multiple of 8), whole groups of 8 blocks (64 elements) from the start,
// two groups at a time (philox8_rounds: independent chains), calls piece(e, keep16) for
// each 16 elements from e (relative to first) with keep16's 16-bit lanes 0xFFFF where
// kept (bits >= threshold, unsigned); returns `done`, 0 where it does not apply (a threshold
// of 65536: p rounds to 1, which the 16-bit compare cannot hold). The caller does the rest
// through the general path.
template <typename Piece>
int64_t philox8_pieces(const DropoutArgs& draw, int64_t first, int64_t n, Piece&& piece) {
  constexpr int64_t B = math::kDropoutBlock;
  constexpr int64_t kGroup = kLanes * B;  // 64 elements
  if (first % B != 0 || draw.threshold > 0xFFFFu) return 0;
  const __m256i threshold = _mm256_set1_epi16(static_cast<short>(static_cast<uint16_t>(draw.threshold)));
  const PhiloxKeys8 keys(draw.seed);
  uint64_t block = static_cast<uint64_t>(first / B);
  int64_t done = 0;
  while (done + kGroup <= n && static_cast<uint32_t>(block) <= 0xFFFFFFFFu - 2 * kLanes) {
    const int groups = done + 2 * kGroup <= n ? 2 : 1;
    __m256i words[2][4];
    philox8_groups<2>(keys, draw.offset, block, words);
    for (int g = 0; g < groups; ++g, done += kGroup, block += kLanes) {
      for (int k = 0; k < 4; ++k) {
        piece(done + 16 * k, _mm256_cmpeq_epi16(_mm256_max_epu16(words[g][k], threshold), words[g][k]));
      }
    }
  }
  return done;
}

// keep16's lanes widened to 32 bits (elements 0-7, 8-15) AND the scale: the factors.
inline void keep16_factors(__m256i keep16, __m256 scale, __m256& f0, __m256& f1) {
  f0 = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(keep16))), scale);
  f1 = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(keep16, 1))), scale);
}

// float32 dropout applied straight from the Philox registers in one pass, with no bits or
// factors arrays in between (those were two more passes over an L1 chunk: bits ->
// factors -> multiply, benchmarks/NOTES.md items 5 and 11): v = src * (kept ? scale : 0),
// stored to dst (kStore) and/or added to acc (kAcc), over philox8_pieces' elements. The same
// bits, keep test and product as dropout_factors + combine: bit for bit that path's results
// (tests/python/test_add_position_dropout_bits.py).
template <bool kStore, bool kAcc>
int64_t masked_f32_avx2(const DropoutArgs& draw, int64_t first, int64_t n, const float* src,
                        float* dst, float* acc) {
  const __m256 scale = _mm256_set1_ps(math::dropout_scale<float>(draw.keep_prob));
  return philox8_pieces(draw, first, n, [&](int64_t e, __m256i keep16) {
    __m256 f[2];
    keep16_factors(keep16, scale, f[0], f[1]);
    for (int h = 0; h < 2; ++h) {
      const int64_t at = e + 8 * h;
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + at), f[h]);
#if defined(__GNUC__)
      // The product is rounded before the sum, as grad_x holds it: without this GCC
      // contracts the mul and the add below into one FMA when v is not stored (kAcc
      // only), and the table gradient would then differ with and without grad_x.
      __asm__("" : "+x"(v));
#endif
      if constexpr (kStore) _mm256_storeu_ps(dst + at, v);
      if constexpr (kAcc) _mm256_storeu_ps(acc + at, _mm256_add_ps(_mm256_loadu_ps(acc + at), v));
    }
  });
}

// The 8 factors of one byte of the saved keep mask: the byte broadcast to 8 lanes, lane i
// all ones where bit i is set (kept), AND the scale; 0 elsewhere.
inline __m256 keep_byte_factors(uint8_t byte, __m256 scale) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i keep =
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(byte), lane_bit), lane_bit);
  return _mm256_and_ps(_mm256_castsi256_ps(keep), scale);
}

// masked_f32_avx2's product and stores with the factors read from the saved keep mask
// (bits[k / 8] bit k % 8 for element k, from a byte boundary): whole bytes (8 elements)
// from the start; returns the count done. The same factors and product as the general
// path (keep_bits_factors + multiply), so the same results bit for bit.
template <bool kStore, bool kAcc>
int64_t masked_bits_f32_avx2(const uint8_t* bits, float scale_f, int64_t n, const float* src,
                             float* dst, float* acc) {
  const __m256 scale = _mm256_set1_ps(scale_f);
  int64_t done = 0;
  for (; done + 8 <= n; done += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + done), keep_byte_factors(bits[done / 8], scale));
#if defined(__GNUC__)
    __asm__("" : "+x"(v));  // rounded before the sum, as in masked_f32_avx2
#endif
    if constexpr (kStore) _mm256_storeu_ps(dst + done, v);
    if constexpr (kAcc) _mm256_storeu_ps(acc + done, _mm256_add_ps(_mm256_loadu_ps(acc + done), v));
  }
  return done;
}

// The keep masks of all 256 bytes of the saved mask: entry b, lane i all ones where bit i
// of b is set. A factor vector is then one load and one AND with the scale (keep_byte_factors
// builds the same vector from the byte in five vector instructions; the half-precision loops
// below are short of vector issue slots, not of memory, with one thread: measured, issue 37).
struct KeepMaskTable {
  alignas(64) int32_t lanes[256][8];
  KeepMaskTable() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) lanes[b][i] = (b >> i) & 1 ? -1 : 0;
  }
};

inline __m256 keep_factors_of(const KeepMaskTable& table, unsigned index, __m256 scale) {
  return _mm256_and_ps(_mm256_load_ps(reinterpret_cast<const float*>(table.lanes[index])), scale);
}

// The same for bfloat16/float16 src and dst (float32 acc): 16 elements (two mask bytes) at a
// time, widened to float32 and narrowed back with one rounding of the float32 product, as
// the general path's load_as/store_as (ATen's conversions) round; one 256-bit load and
// store each. bfloat16 without acc widens within 128-bit lanes (unpack with zero: elements
// 0-3 and 8-11 in the first vector, 4-7 and 12-15 in the second, their factors permuted
// alike) and narrows back the same way, so no cross-lane shuffle either way. The general
// path took 15-20 instructions of loop and lambda overhead per 8 elements around the same
// arithmetic (benchmarks/NOTES.md, issue 37).
template <bool kStore, bool kAcc, typename scalar_t>
int64_t masked_bits_half_avx2(const uint8_t* bits, float scale_f, int64_t n, const scalar_t* src,
                              scalar_t* dst, float* acc) {
  using VecH = Vectorized<scalar_t>;
  static const KeepMaskTable table;
  const __m256 scale = _mm256_set1_ps(scale_f);
  int64_t done = 0;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kStore && !kAcc) {
    const __m256i zero = _mm256_setzero_si256();
    for (; done + 16 <= n; done += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + done));
      const unsigned w = bits[done / 8] | (unsigned{bits[done / 8 + 1]} << 8);
      const __m256 v0 = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
                                      keep_factors_of(table, (w & 0x0Fu) | ((w >> 4) & 0xF0u), scale));
      const __m256 v1 = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)),
                                      keep_factors_of(table, ((w >> 4) & 0x0Fu) | ((w >> 8) & 0xF0u), scale));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + done),
                          narrow_bf16_lanes(v0, v1));
    }
    return done;
  }
  for (; done + 16 <= n; done += 16) {
    auto [lo, hi] = at::vec::convert_to_float<scalar_t>(VecH::loadu(src + done));
    __m256 v0 = _mm256_mul_ps(lo, keep_factors_of(table, bits[done / 8], scale));
    __m256 v1 = _mm256_mul_ps(hi, keep_factors_of(table, bits[done / 8 + 1], scale));
#if defined(__GNUC__)
    __asm__("" : "+x"(v0), "+x"(v1));  // rounded before the sum, as in masked_f32_avx2
#endif
    if constexpr (kStore) {
      at::vec::convert_from_float<scalar_t>(Vectorized<float>(v0), Vectorized<float>(v1)).store(dst + done);
    }
    if constexpr (kAcc) {
      _mm256_storeu_ps(acc + done, _mm256_add_ps(_mm256_loadu_ps(acc + done), v0));
      _mm256_storeu_ps(acc + done + 8, _mm256_add_ps(_mm256_loadu_ps(acc + done + 8), v1));
    }
  }
  return done;
}

// dropout_fused_avx512's pass in float32 for CPUs without AVX-512: philox8_pieces' keep
// masks, packed to 16 bits for the saved mask (pack_keep_bits' layout) and widened to the
// factors; out = (x [+ t]) * factor. The same bits as the general path (dropout_factors +
// pack_keep_bits + combine); returns the count done. (In half precision the same pass with ATen's conversions measured no gain
// over the general path: 1.00-1.02x, POSENC_CPU_CAPABILITY=avx2 on the Zen 4 host.)
template <bool kTable>
int64_t dropout_fused_f32_avx2(const DropoutArgs& draw, int64_t first, int64_t n, const float* x, const float* t,
                               float* out, uint8_t* keep) {
  const __m256 scale = _mm256_set1_ps(math::dropout_scale<float>(draw.keep_prob));
  return philox8_pieces(draw, first, n, [&](int64_t e, __m256i keep16) {
    if (keep != nullptr) {
      const __m128i packed = _mm_packs_epi16(_mm256_castsi256_si128(keep16), _mm256_extracti128_si256(keep16, 1));
      const uint16_t m = static_cast<uint16_t>(_mm_movemask_epi8(packed));
      std::memcpy(keep + e / 8, &m, sizeof(m));
    }
    __m256 f0, f1;
    keep16_factors(keep16, scale, f0, f1);
    __m256 v0 = _mm256_loadu_ps(x + e), v1 = _mm256_loadu_ps(x + e + 8);
    if constexpr (kTable) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(t + e));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(t + e + 8));
    }
    _mm256_storeu_ps(out + e, _mm256_mul_ps(v0, f0));
    _mm256_storeu_ps(out + e + 8, _mm256_mul_ps(v1, f1));
  });
}
#else
void philox8_bits(uint64_t seed, uint64_t offset, uint64_t block0, int64_t lanes,
                  uint16_t* bits) {
  uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
  for (int i = 0; i < kLanes; ++i) math::dropout_counter(offset, block0 + i, c0[i], c1[i], c2[i], c3[i]);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < math::kPhiloxRounds; ++round) {
    for (int i = 0; i < kLanes; ++i) math::philox_round(c0[i], c1[i], c2[i], c3[i], k0, k1);
    k0 += math::kPhiloxWeyl0;
    k1 += math::kPhiloxWeyl1;
  }
  store_block_bits(c0, c1, c2, c3, lanes, bits);
}
#endif

#if defined(CPU_CAPABILITY_AVX2) && (defined(__GNUC__) || defined(__clang__))
#define POSENC_AVX512_PHILOX 1
constexpr int kWideLanes = 16;  // Philox counters per AVX-512 pass

POSENC_AVX512_WARNINGS_BEGIN

// The AVX-512 form of philox8_rounds for kGroups groups of 16 whole blocks from block0, whose
// indices share their high word: the same rounds on 16 lanes per group, the two XORs of
// each half-round in one ternary-logic instruction, the (hi, lo) halves of the products
// merged by one masked in-lane swap each. The groups are independent chains that the core
// overlaps (one group is a chain of ten dependent rounds): a standalone loop over 1024
// elements on the Zen 4 host, 1 thread, 0.29 ns per element for the previous one-group form
// (shift + blend merges), 0.25 with the swaps, 0.20 for two groups, 0.18 for four, 0.25 for
// eight (spills). words[g][k] holds elements 32 k .. 32 k + 31 of group g's 128 (block i's
// four words at 16-bit element 8 i: dropout_lane_bits order). Compiled for AVX-512 by
// attribute (the file targets AVX2) and called only when the CPU reports AVX-512F/BW/VL at
// run time; gtest compares its bits with the scalar header's
// (DropoutMask.CpuKernelDrawsTheSharedScalarBits).
template <int kGroups>
POSENC_AVX512_TARGET __attribute__((always_inline)) inline void philox16_groups(uint64_t seed, uint64_t offset,
                                                                                uint64_t block0,
                                                                                __m512i (&words)[kGroups][4]) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i v[kGroups][4];
  for (int g = 0; g < kGroups; ++g) {
    v[g][0] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 2)));
    v[g][1] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 34)));
    v[g][2] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0 + 16 * g))), lanes);
    v[g][3] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0 >> 32)));
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const __m512i mul0 = _mm512_set1_epi32(static_cast<int>(math::kPhiloxMul0));
  const __m512i mul1 = _mm512_set1_epi32(static_cast<int>(math::kPhiloxMul1));
  constexpr __mmask16 kOdd = 0xAAAA, kEven = 0x5555;
  for (int round = 0; round < math::kPhiloxRounds; ++round) {
    const __m512i key0 = _mm512_set1_epi32(static_cast<int>(k0)), key1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < kGroups; ++g) {
      // The 64-bit products of the even lanes (e) and of the odd lanes shifted down (o): lo
      // of lane 2i is e's low word, of lane 2i + 1 o's low word (swapped up); hi of lane 2i
      // is e's high word (swapped down), of lane 2i + 1 o's high word.
      const __m512i e0 = _mm512_mul_epu32(v[g][0], mul0);
      const __m512i o0 = _mm512_mul_epu32(_mm512_srli_epi64(v[g][0], 32), mul0);
      const __m512i e1 = _mm512_mul_epu32(v[g][2], mul1);
      const __m512i o1 = _mm512_mul_epu32(_mm512_srli_epi64(v[g][2], 32), mul1);
      const __m512i lo0 = _mm512_mask_shuffle_epi32(e0, kOdd, o0, _MM_PERM_CDAB);
      const __m512i hi0 = _mm512_mask_shuffle_epi32(o0, kEven, e0, _MM_PERM_CDAB);
      const __m512i lo1 = _mm512_mask_shuffle_epi32(e1, kOdd, o1, _MM_PERM_CDAB);
      const __m512i hi1 = _mm512_mask_shuffle_epi32(o1, kEven, e1, _MM_PERM_CDAB);
      // 0x96: a ^ b ^ c.
      v[g][0] = _mm512_ternarylogic_epi32(hi1, v[g][1], key0, 0x96);
      v[g][1] = lo1;
      v[g][2] = _mm512_ternarylogic_epi32(hi0, v[g][3], key1, 0x96);
      v[g][3] = lo0;
    }
    k0 += math::kPhiloxWeyl0;
    k1 += math::kPhiloxWeyl1;
  }
  // 4 x 16 transpose of 32-bit words to block order: within each 128-bit lane as in
  // philox8_bits (a holds blocks 0, 4, 8, 12; b 1, 5, ...), then a 4 x 4 transpose of the
  // 128-bit lanes.
  for (int g = 0; g < kGroups; ++g) {
    const __m512i t0 = _mm512_unpacklo_epi32(v[g][0], v[g][1]), t1 = _mm512_unpackhi_epi32(v[g][0], v[g][1]);
    const __m512i t2 = _mm512_unpacklo_epi32(v[g][2], v[g][3]), t3 = _mm512_unpackhi_epi32(v[g][2], v[g][3]);
    const __m512i a = _mm512_unpacklo_epi64(t0, t2), b = _mm512_unpackhi_epi64(t0, t2);
    const __m512i c = _mm512_unpacklo_epi64(t1, t3), d = _mm512_unpackhi_epi64(t1, t3);
    const __m512i ab01 = _mm512_shuffle_i32x4(a, b, 0x44), cd01 = _mm512_shuffle_i32x4(c, d, 0x44);
    const __m512i ab23 = _mm512_shuffle_i32x4(a, b, 0xEE), cd23 = _mm512_shuffle_i32x4(c, d, 0xEE);
    words[g][0] = _mm512_shuffle_i32x4(ab01, cd01, 0x88);
    words[g][1] = _mm512_shuffle_i32x4(ab01, cd01, 0xDD);
    words[g][2] = _mm512_shuffle_i32x4(ab23, cd23, 0x88);
    words[g][3] = _mm512_shuffle_i32x4(ab23, cd23, 0xDD);
  }
}

// The bits of kGroups * 16 whole blocks (philox16_groups) stored in element order.
template <int kGroups>
POSENC_AVX512_TARGET void philox16_bits(uint64_t seed, uint64_t offset, uint64_t block0, uint16_t* bits) {
  __m512i words[kGroups][4];
  philox16_groups<kGroups>(seed, offset, block0, words);
  for (int g = 0; g < kGroups; ++g) {
    for (int k = 0; k < 4; ++k) _mm512_storeu_si512(bits + g * 128 + k * 32, words[g][k]);
  }
}

// The 128 elements of one group from its Philox words: the keep mask of 32 elements is one
// compare (bits >= threshold), stored as it is when the mask is saved (bit i = element i:
// pack_keep_bits' layout), and out = (x [+ t]) * (kept ? scale : 0), one rounding each, as
// combine_as computes it.
template <bool kTable, bool kStream, typename scalar_t, typename table_t>
POSENC_AVX512_TARGET __attribute__((always_inline)) inline void dropout_group(const __m512i (&words)[4], __m512i threshold,
                                                                             __m512 scale, const scalar_t* x,
                                                                             const table_t* t, scalar_t* out,
                                                                             uint8_t* keep) {
  for (int k = 0; k < 4; ++k) {
    const __mmask32 kept = _mm512_cmpge_epu16_mask(words[k], threshold);
    if (keep != nullptr) {
      const uint32_t m = kept;
      std::memcpy(keep + 4 * k, &m, sizeof(m));
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t at = 32 * k + 16 * h;
      __m512 v = load16(x + at);
      if constexpr (kTable) v = _mm512_add_ps(v, load16(t + at));
      v = _mm512_mul_ps(v, _mm512_maskz_mov_ps(static_cast<__mmask16>(kept >> (16 * h)), scale));
      if constexpr (kStream) {
        static_assert(std::is_same_v<scalar_t, float>, "dropout_group streams float32 outputs only");
        _mm512_stream_ps(out + at, v);
      } else {
        store16(out + at, v);
      }
    }
  }
}

// Dropout straight from the Philox registers for elements [first, first + done) of the call
// (first a multiple of 8): out = (x [+ t]) * factor, the keep mask into keep (from its
// element 0, a byte boundary) when not null. Whole groups of 128 elements, four groups at a
// time while they last; returns `done`, the caller does the rest through the general path.
// The same bits, keep test and products as dropout_factors + pack_keep_bits + combine: bit
// for bit that path's results (test_cpu_capability.py compares the levels' outputs). In one
// pass over the data where the general path makes four over an L1 chunk (bits, factors, the
// mask, the combine).
template <bool kTable, bool kStream, typename scalar_t, typename table_t>
POSENC_AVX512_TARGET int64_t dropout_fused_avx512(const DropoutArgs& draw, int64_t first, int64_t n,
                                                  const scalar_t* x, const table_t* t, scalar_t* out,
                                                  uint8_t* keep) {
  constexpr int64_t B = math::kDropoutBlock, kGroup = kWideLanes * B;  // 128 elements
  if (first % B != 0 || draw.threshold > 0xFFFFu) return 0;
  const __m512i threshold = _mm512_set1_epi16(static_cast<short>(static_cast<uint16_t>(draw.threshold)));
  const __m512 scale = _mm512_set1_ps(math::dropout_scale<float>(draw.keep_prob));
  uint64_t block = static_cast<uint64_t>(first / B);
  int64_t done = 0;
  const auto at = [&](auto* p, int64_t e) { return p == nullptr ? p : p + e; };
  constexpr int kGroups = 4;  // 2 and 3: 1.08-1.13x the time at 1 thread (the spills of 4 cost less)
  for (; done + kGroups * kGroup <= n && static_cast<uint32_t>(block) <= 0xFFFFFFFFu - kGroups * kWideLanes;
       done += kGroups * kGroup, block += kGroups * kWideLanes) {
    __m512i words[kGroups][4];
    philox16_groups<kGroups>(draw.seed, draw.offset, block, words);
    for (int g = 0; g < kGroups; ++g) {
      const int64_t e = done + g * kGroup;
      dropout_group<kTable, kStream>(words[g], threshold, scale, x + e, at(t, e), out + e, at(keep, e / 8));
    }
  }
  for (; done + kGroup <= n && static_cast<uint32_t>(block) <= 0xFFFFFFFFu - kWideLanes;
       done += kGroup, block += kWideLanes) {
    __m512i words[1][4];
    philox16_groups<1>(draw.seed, draw.offset, block, words);
    dropout_group<kTable, kStream>(words[0], threshold, scale, x + done, at(t, done), out + done,
                                   at(keep, done / 8));
  }
  return done;
}
// The saved keep mask's product for `rows` rows of n elements (from a mask byte boundary):
// 16 elements a time, their two mask bytes one AVX-512 mask register (bit i = element i,
// pack_keep_bits' layout), dst[i] = src[i] * (kept ? scale : 0) when kStore, the products
// added to acc in row order when kAcc; returns the count done (whole groups of 16). The same
// factors, products and roundings as masked_bits_half_avx2 / masked_saved_rows_fast (whose
// rounding ATen's conversions make: narrow_bf16_512, vcvtps2ph), without their mask table
// and cross-lane widening.
template <bool kStore, bool kAcc, typename scalar_t>
POSENC_AVX512_TARGET int64_t masked_bits_avx512(const uint8_t* const* bits, const scalar_t* const* src,
                                                scalar_t* const* dst, int64_t rows, int64_t n, float scale_f,
                                                float* acc) {
  const __m512 scale = _mm512_set1_ps(scale_f);
  int64_t done = 0;
  for (; done + 16 <= n; done += 16) {
    __m512 a = kAcc ? _mm512_loadu_ps(acc + done) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      uint16_t m;
      std::memcpy(&m, bits[i] + done / 8, sizeof(m));
      __m512 v = _mm512_mul_ps(load16(src[i] + done), _mm512_maskz_mov_ps(static_cast<__mmask16>(m), scale));
#if defined(__GNUC__)
      __asm__("" : "+v"(v));  // rounded before the sum, as in masked_f32_avx2
#endif
      if constexpr (kStore) store16(dst[i] + done, v);
      if constexpr (kAcc) a = _mm512_add_ps(a, v);
    }
    if constexpr (kAcc) _mm512_storeu_ps(acc + done, a);
  }
  return done;
}
POSENC_AVX512_WARNINGS_END

#endif

// masked_f32_avx2 where it applies: returns the count of leading elements it did, 0
// elsewhere (other dtypes, no dropout, the plain build, and CPUs with AVX-512, which take
// dropout_fast or the 16-lane Philox of dropout_bits: faster than this path on an AMD EPYC
// Zen 4 host even as separate passes, sinusoidal train forward (32, 512, 512) float32 2.55 ms
// against 3.00 with POSENC_CPU_CAPABILITY=avx2, bfloat16 2.43 against 3.11;
// benchmarks/NOTES.md).
template <bool kStore, bool kAcc, typename scalar_t, typename acc_t>
int64_t masked_fast(const DropoutArgs& draw, int64_t first, int64_t n, const scalar_t* src,
                    scalar_t* dst, acc_t* acc) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
    if (draw.keep_bits != nullptr) return 0;  // masked_saved_fast's case
#if defined(POSENC_AVX512_PHILOX)
    const bool avx512 = cpu_has_avx512();
#else
    const bool avx512 = false;
#endif
    if (draw.active && !avx512) return masked_f32_avx2<kStore, kAcc>(draw, first, n, src, dst, acc);
  }
#endif
  (void)draw, (void)first, (void)n, (void)src, (void)dst, (void)acc;
  return 0;
}

// dropout_fused_avx512 (CPUs with AVX-512: float32, bfloat16 or float16 with a table of the
// same dtype or float32, or none) or dropout_fused_f32_avx2 (other CPUs of the AVX2 build,
// float32) where they apply: returns the count of leading elements done, 0 elsewhere.
template <typename scalar_t, typename table_t>
int64_t dropout_fast(const DropoutArgs& draw, int64_t first, int64_t n, const scalar_t* x, const table_t* t,
                     scalar_t* out, uint8_t* keep, bool stream = false) {
#if defined(POSENC_AVX512_PHILOX)
  constexpr bool kHalf = std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>;
  if constexpr ((std::is_same_v<scalar_t, float> || kHalf) &&
                (std::is_same_v<table_t, scalar_t> || std::is_same_v<table_t, float>)) {
    if (draw.active && draw.keep_bits == nullptr) {
      if (cpu_has_avx512()) {
        // `stream` (a call that writes kStreamBytes or more): streaming stores where out is
        // 64-byte aligned (the caller fences); float32 only: a float32 train forward 0.75x,
        // half precision (compute-bound here) 1.01-1.04x (benchmarks/NOTES.md).
        if constexpr (std::is_same_v<scalar_t, float>) {
          if (stream && reinterpret_cast<std::uintptr_t>(out) % 64 == 0) {
            return t != nullptr ? dropout_fused_avx512<true, true>(draw, first, n, x, t, out, keep)
                                : dropout_fused_avx512<false, true>(draw, first, n, x, t, out, keep);
          }
        }
        return t != nullptr ? dropout_fused_avx512<true, false>(draw, first, n, x, t, out, keep)
                            : dropout_fused_avx512<false, false>(draw, first, n, x, t, out, keep);
      }
      if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<table_t, float>) {
        return t != nullptr ? dropout_fused_f32_avx2<true>(draw, first, n, x, t, out, keep)
                            : dropout_fused_f32_avx2<false>(draw, first, n, x, t, out, keep);
      }
    }
  }
#endif
  (void)draw, (void)first, (void)n, (void)x, (void)t, (void)out, (void)keep;
  return 0;
}

// masked_bits_f32_avx2 / masked_bits_half_avx2 where they apply (float32, bfloat16 or
// float16 with float32 accumulators, saved mask, AVX2 build): elements [j, j + n) of row
// r; returns the count of leading elements done, 0 elsewhere.
template <bool kStore, bool kAcc, typename scalar_t, typename acc_t>
int64_t masked_saved_fast(const DropoutArgs& draw, int64_t d, int64_t r, int64_t j, int64_t n,
                          const scalar_t* src, scalar_t* dst, acc_t* acc) {
#if defined(POSENC_AVX512_PHILOX)
  if constexpr (std::is_same_v<acc_t, float> &&
                (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>)) {
    if (draw.keep_bits != nullptr && cpu_has_avx512()) {
      const uint8_t* bits = draw.keep_bits + r * keep_row_bytes(d) + j / 8;
      return masked_bits_avx512<kStore, kAcc>(&bits, &src, &dst, 1, n, math::dropout_scale<float>(draw.keep_prob), acc);
    }
  }
#endif
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
    if (draw.keep_bits != nullptr) {
      return masked_bits_f32_avx2<kStore, kAcc>(draw.keep_bits + r * keep_row_bytes(d) + j / 8,
                                                math::dropout_scale<float>(draw.keep_prob), n, src, dst, acc);
    }
  } else if constexpr (std::is_same_v<acc_t, float> && (std::is_same_v<scalar_t, c10::BFloat16> ||
                                                        std::is_same_v<scalar_t, c10::Half>)) {
    if (draw.keep_bits != nullptr) {
      return masked_bits_half_avx2<kStore, kAcc>(draw.keep_bits + r * keep_row_bytes(d) + j / 8,
                                                 math::dropout_scale<float>(draw.keep_prob), n, src, dst, acc);
    }
  }
#endif
  (void)draw, (void)d, (void)r, (void)j, (void)n, (void)src, (void)dst, (void)acc;
  return 0;
}

// masked_saved_fast's product, store and accumulation for `rows` rows at once (the table
// gradient's batch rows b..b+rows-1 of one s: the same column range, the same
// accumulators), saved mask, AVX2 build, float32 accumulators: each accumulator vector is
// loaded and stored once per group for all the rows instead of once per row, and the rows'
// products are added in row order, so every sum is the one of the row-by-row loop, bit for
// bit. Returns the count of leading elements done in every row (0 where it does not apply).
template <typename scalar_t, typename acc_t>
int64_t masked_saved_rows_fast(const DropoutArgs& draw, int64_t d, const int64_t* r, int64_t rows, int64_t j,
                               int64_t n, const scalar_t* grad, scalar_t* grad_x, acc_t* acc, bool stream = false) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float> &&
                (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                 std::is_same_v<scalar_t, c10::Half>)) {
    if (draw.keep_bits == nullptr || grad_x == nullptr) return 0;
    constexpr int64_t kMaxRows = 8;
    const uint8_t* bits[kMaxRows];
    const scalar_t* src[kMaxRows];
    scalar_t* dst[kMaxRows];
    rows = std::min(rows, kMaxRows);
    for (int64_t i = 0; i < rows; ++i) {
      bits[i] = draw.keep_bits + r[i] * keep_row_bytes(d) + j / 8;
      src[i] = grad + r[i] * d + j;
      dst[i] = grad_x + r[i] * d + j;
    }
#if defined(POSENC_AVX512_PHILOX)
    if constexpr (!std::is_same_v<scalar_t, float>) {
      if (cpu_has_avx512()) {
        // (Half-precision grad_x stores plainly: streamed, 1.00-1.10x the time: compute-bound.)
        return masked_bits_avx512<true, true>(bits, src, dst, rows, n, math::dropout_scale<float>(draw.keep_prob), acc);
      }
    }
#endif
    const __m256 scale = _mm256_set1_ps(math::dropout_scale<float>(draw.keep_prob));
    int64_t done = 0;
    if constexpr (std::is_same_v<scalar_t, float>) {
      // `stream` (a call that writes kStreamBytes or more): grad_x by streaming stores where
      // every row's is 32-byte aligned (the caller fences): float32 learned backward 0.87x.
      for (int64_t i = 0; stream && i < rows; ++i) stream = reinterpret_cast<std::uintptr_t>(dst[i]) % 32 == 0;
      for (; done + 8 <= n; done += 8) {
        __m256 a = _mm256_loadu_ps(acc + done);
        for (int64_t i = 0; i < rows; ++i) {
          __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src[i] + done), keep_byte_factors(bits[i][done / 8], scale));
#if defined(__GNUC__)
          __asm__("" : "+x"(v));  // rounded before the sum, as in masked_bits_f32_avx2
#endif
          if (stream) {
            _mm256_stream_ps(dst[i] + done, v);
          } else {
            _mm256_storeu_ps(dst[i] + done, v);
          }
          a = _mm256_add_ps(a, v);
        }
        _mm256_storeu_ps(acc + done, a);
      }
    } else {
      using VecH = Vectorized<scalar_t>;
      static const KeepMaskTable table;
      for (; done + 16 <= n; done += 16) {
        __m256 a0 = _mm256_loadu_ps(acc + done), a1 = _mm256_loadu_ps(acc + done + 8);
        for (int64_t i = 0; i < rows; ++i) {
          auto [lo, hi] = at::vec::convert_to_float<scalar_t>(VecH::loadu(src[i] + done));
          __m256 v0 = _mm256_mul_ps(lo, keep_factors_of(table, bits[i][done / 8], scale));
          __m256 v1 = _mm256_mul_ps(hi, keep_factors_of(table, bits[i][done / 8 + 1], scale));
#if defined(__GNUC__)
          __asm__("" : "+x"(v0), "+x"(v1));  // as in masked_bits_half_avx2
#endif
          at::vec::convert_from_float<scalar_t>(Vectorized<float>(v0), Vectorized<float>(v1)).store(dst[i] + done);
          a0 = _mm256_add_ps(a0, v0);
          a1 = _mm256_add_ps(a1, v1);
        }
        _mm256_storeu_ps(acc + done, a0);
        _mm256_storeu_ps(acc + done + 8, a1);
      }
    }
    return done;
  }
#endif
  (void)draw, (void)d, (void)r, (void)rows, (void)j, (void)n, (void)grad, (void)grad_x, (void)acc;
  return 0;
}

// 16 random bits for each element of dropout blocks [block0, block0 + nblocks).
void dropout_bits(uint64_t seed, uint64_t offset, uint64_t block0, int64_t nblocks,
                  uint16_t* bits) {
  int64_t b = 0;
#if defined(POSENC_AVX512_PHILOX)
  if (cpu_has_avx512()) {
    // Whole groups of 16 blocks whose indices share their high word, four at a time while
    // they last; the rest below.
    for (; b + 4 * kWideLanes <= nblocks &&
           static_cast<uint32_t>(block0 + b) <= 0xFFFFFFFFu - 4 * kWideLanes;
         b += 4 * kWideLanes) {
      philox16_bits<4>(seed, offset, block0 + b, bits + b * math::kDropoutBlock);
    }
    for (; b + kWideLanes <= nblocks &&
           static_cast<uint32_t>(block0 + b) <= 0xFFFFFFFFu - kWideLanes;
         b += kWideLanes) {
      philox16_bits<1>(seed, offset, block0 + b, bits + b * math::kDropoutBlock);
    }
  }
#endif
#if defined(CPU_CAPABILITY_AVX2)
  if (b + 2 * kLanes <= nblocks) {
    const PhiloxKeys8 keys(seed);
    for (; b + 2 * kLanes <= nblocks && static_cast<uint32_t>(block0 + b) <= 0xFFFFFFFFu - 2 * kLanes;
         b += 2 * kLanes) {
      philox8_bits2(keys, offset, block0 + b, bits + b * math::kDropoutBlock);
    }
  }
#endif
  for (; b < nblocks; b += kLanes) {
    philox8_bits(seed, offset, block0 + b, std::min<int64_t>(kLanes, nblocks - b),
                 bits + b * math::kDropoutBlock);
  }
}

// factors[k] = scale or 0 for elements first .. first + n - 1 of the call (n <= kChunk).
template <typename acc_t>
void dropout_factors(const DropoutArgs& draw, int64_t first, int64_t n, acc_t* factors) {
  constexpr int64_t B = math::kDropoutBlock;
  alignas(64) uint16_t bits[kChunk + 2 * B * kLanes];
  const int64_t block0 = first / B;
  const int64_t nblocks = (first + n + B - 1) / B - block0;
  dropout_bits(draw.seed, draw.offset, static_cast<uint64_t>(block0), nblocks, bits);
  const uint16_t* mine = bits + (first - block0 * B);
  const acc_t scale = math::dropout_scale<acc_t>(draw.keep_prob);
  const uint32_t threshold = draw.threshold;
  for (int64_t k = 0; k < n; ++k) factors[k] = mine[k] >= threshold ? scale : acc_t(0);
}

// The saved keep mask (DropoutArgs): bits[k / 8] bit k % 8 = (factors[k] != 0) for k < n,
// from a byte boundary; the padding bits of a last partial byte are 0. A kept element's
// factor is the scale, which is > 0 (p < 1; for p == 1 nothing is kept).
template <typename acc_t>
void pack_keep_bits(const acc_t* factors, int64_t n, uint8_t* bits) {
  int64_t k = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m256 zero = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
      const __m256 kept = _mm256_cmp_ps(_mm256_loadu_ps(factors + k), zero, _CMP_NEQ_UQ);
      bits[k / 8] = static_cast<uint8_t>(_mm256_movemask_ps(kept));
    }
  }
#endif
  for (; k < n; k += 8) {
    uint8_t byte = 0;
    for (int64_t i = 0; i < 8 && k + i < n; ++i) {
      byte = static_cast<uint8_t>(byte | ((factors[k + i] != acc_t(0) ? 1u : 0u) << i));
    }
    bits[k / 8] = byte;
  }
}

// factors[k] = scale or 0 from the saved keep mask: bit k % 8 of bits[k / 8], k < n.
template <typename acc_t>
void keep_bits_factors(const uint8_t* bits, int64_t n, acc_t scale, acc_t* factors) {
  int64_t k = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(factors + k, keep_byte_factors(bits[k / 8], vscale));
  }
#endif
  for (; k < n; ++k) factors[k] = ((bits[k >> 3] >> (k & 7)) & 1) != 0 ? scale : acc_t(0);
}

// The factors of elements [j, j + n) of row r (j a multiple of 8 when the mask is saved):
// read from the saved mask when there is one, else regenerated from the key.
template <typename acc_t>
void row_factors(const DropoutArgs& draw, int64_t d, int64_t r, int64_t j, int64_t n,
                 acc_t* factors) {
  if (draw.keep_bits != nullptr) {
    keep_bits_factors<acc_t>(draw.keep_bits + r * keep_row_bytes(d) + j / 8, n,
                             math::dropout_scale<acc_t>(draw.keep_prob), factors);
  } else {
    dropout_factors<acc_t>(draw, r * d + j, n, factors);
  }
}

// bfloat16/float16 widened to float (and narrowed back) a whole vector at a time.
template <typename T, typename acc_t>
constexpr bool kReducedToFloat =
    std::is_same_v<acc_t, float> && (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>);

template <typename T, typename acc_t>
Vectorized<acc_t> load_as(const T* src, int64_t n) {
  constexpr int64_t W = Vectorized<acc_t>::size();
  if constexpr (std::is_same_v<T, acc_t>) {
    return n == W ? Vectorized<acc_t>::loadu(src) : Vectorized<acc_t>::loadu(src, n);
  } else if constexpr (kReducedToFloat<T, acc_t>) {
    Vectorized<float> v;
    if (n == W) {
      at::vec::load_to_float<T>(src, v);
    } else {
      alignas(64) T buf[W] = {};
      std::copy(src, src + n, buf);
      at::vec::load_to_float<T>(buf, v);
    }
    return v;
  } else {
    alignas(64) acc_t buf[W] = {};
    for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<acc_t>(src[k]);
    return Vectorized<acc_t>::loadu(buf);
  }
}

template <typename T, typename acc_t>
void store_as(const Vectorized<acc_t>& v, T* dst, int64_t n) {
  constexpr int64_t W = Vectorized<acc_t>::size();
  if constexpr (std::is_same_v<T, acc_t>) {
    if (n == W) v.store(dst); else v.store(dst, n);
  } else if constexpr (kReducedToFloat<T, acc_t>) {
    const Vectorized<T> narrowed = at::vec::convert_from_float<T>(v, v);  // the first W of 2 W
#if defined(CPU_CAPABILITY_AVX2)
    if (n == W) {  // a whole vector: one 128-bit store (store(dst, n) goes through memcpy)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(narrowed));
      return;
    }
#endif
    narrowed.store(dst, n);
  } else {
    alignas(64) acc_t buf[W];
    v.store(buf);
    for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<T>(buf[k]);
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// A whole vector v to dst (aligned to its stored width) by a streaming store, rounded to T as
// store_as rounds it: the same bits.
template <typename T, typename acc_t>
inline void stream_as(const Vectorized<acc_t>& v, T* dst) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<acc_t, float>) {
    _mm256_stream_ps(dst, v);
  } else if constexpr (std::is_same_v<T, double> && std::is_same_v<acc_t, double>) {
    _mm256_stream_pd(dst, v);
  } else {
    static_assert(kReducedToFloat<T, acc_t>, "stream_as: float32, float64 or a reduced type through float32");
    const Vectorized<T> narrowed = at::vec::convert_from_float<T>(v, v);  // the first W of 2 W
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(narrowed));
  }
}

// Whether combine_as may stream into out: whole vectors of T start aligned there.
template <typename T, typename acc_t>
inline bool streams_into(const T* out) {
  const std::uintptr_t width = Vectorized<acc_t>::size() * sizeof(T);
  return reinterpret_cast<std::uintptr_t>(out) % width == 0;
}
#endif

// out[j] = (x[j] + t[j]) * factors[j] for j < n, for a table (kTable) and factors
// (kScale) known at compile time. Four vectors per iteration while they are full: the
// loop streams x and out through memory, and the wider body keeps more loads in flight
// (measured: benchmarks/NOTES.md, CPU items 10 and 13). `stream` (a call that writes
// kStreamBytes or more): whole vectors into an aligned out by streaming stores (the caller
// fences), so that out's lines are not read first; the same sums and roundings.
template <bool kTable, bool kScale, typename scalar_t, typename table_t, typename acc_t>
void combine_as(const scalar_t* x, const table_t* t, const acc_t* factors, scalar_t* out, int64_t n,
                bool stream = false) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t kUnroll = 4;
  auto value = [&](int64_t j, int64_t m) {
    Vec v = load_as<scalar_t, acc_t>(x + j, m);
    if constexpr (kTable) v = v + load_as<table_t, acc_t>(t + j, m);
    if constexpr (kScale) v = v * load_as<acc_t, acc_t>(factors + j, m);
    return v;
  };
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kTable && !kScale && std::is_same_v<scalar_t, c10::BFloat16> &&
                std::is_same_v<table_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    // bfloat16 x and table (the eval forward): 16 elements widened within 128-bit lanes
    // (unpack with zero), added, rounded as ATen's cvtfp32_bf16 and packed back without a
    // cross-lane permute: the same sums and roundings as the loop below in fewer vector
    // instructions, which bound it (issue 37: perf, one thread).
    const __m256i zero = _mm256_setzero_si256();
    const bool streamed = stream && reinterpret_cast<std::uintptr_t>(out) % 32 == 0;
    for (; j + 16 <= n; j += 16) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
      const __m256i tv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + j));
      const __m256 s0 = _mm256_add_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, xv)),
                                      _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, tv)));
      const __m256 s1 = _mm256_add_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, xv)),
                                      _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, tv)));
      auto* dst = reinterpret_cast<__m256i*>(out + j);
      if (streamed) {
        _mm256_stream_si256(dst, narrow_bf16_lanes(s0, s1));
      } else {
        _mm256_storeu_si256(dst, narrow_bf16_lanes(s0, s1));
      }
    }
  }
  if (stream && streams_into<scalar_t, acc_t>(out)) {
    for (; j + kUnroll * W <= n; j += kUnroll * W) {
      Vec v[kUnroll];
      for (int64_t u = 0; u < kUnroll; ++u) v[u] = value(j + u * W, W);
      for (int64_t u = 0; u < kUnroll; ++u) stream_as<scalar_t, acc_t>(v[u], out + j + u * W);
    }
  }
#endif
  for (; j + kUnroll * W <= n; j += kUnroll * W) {
    Vec v[kUnroll];
    for (int64_t u = 0; u < kUnroll; ++u) v[u] = value(j + u * W, W);
    for (int64_t u = 0; u < kUnroll; ++u) store_as<scalar_t, acc_t>(v[u], out + j + u * W, W);
  }
  for (; j < n; j += W) {
    const int64_t m = std::min<int64_t>(W, n - j);
    store_as<scalar_t, acc_t>(value(j, m), out + j, m);
  }
}

// The same with t and factors possibly null (no table row, no dropout).
template <typename scalar_t, typename table_t, typename acc_t>
void combine(const scalar_t* x, const table_t* t, const acc_t* factors, scalar_t* out, int64_t n,
             bool stream = false) {
  if (t != nullptr) {
    if (factors != nullptr) combine_as<true, true>(x, t, factors, out, n, stream);
    else combine_as<true, false>(x, t, factors, out, n, stream);
  } else {
    if (factors != nullptr) combine_as<false, true>(x, t, factors, out, n, stream);
    else combine_as<false, false>(x, t, factors, out, n, stream);
  }
}

// The table row that output row r reads.
inline int64_t row_position(const AddPositionArgs& g, const int64_t* positions, int64_t r) {
  const int64_t b = g.batch_first ? r / g.seq : r % g.batch;
  const int64_t s = g.batch_first ? r % g.seq : r / g.batch;
  return positions != nullptr ? positions[b * g.positions_batch_stride + s] : g.offset + s;
}

}  // namespace

template <typename scalar_t, typename table_t>
void add_position_rows(const AddPositionArgs& g, const scalar_t* x, const table_t* table,
                       const int64_t* positions, const DropoutArgs& draw, scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = g.batch * g.seq;
  const int64_t d = g.d;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  // A large call's output (a fresh tensor) by streaming stores.
  const bool stream = rows * d * static_cast<int64_t>(sizeof(scalar_t)) >= kStreamBytes;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    alignas(64) acc_t factors[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t pos = row_position(g, positions, r);
      const scalar_t* x_row = x + r * d;
      const table_t* t_row = table + pos * d;
      scalar_t* o_row = out + r * d;
      for (int64_t j0 = 0; j0 < d; j0 += kChunk) {
        uint8_t* keep = draw.keep_bits_out != nullptr ? draw.keep_bits_out + r * keep_row_bytes(d) + j0 / 8 : nullptr;
        const int64_t chunk = std::min(kChunk, d - j0);
        // The fused AVX-512 pass does whole groups from the start (a multiple of 128
        // elements, so the rest starts on a mask byte); the general path the rest.
        const int64_t done = dropout_fast(draw, r * d + j0, chunk, x_row + j0, t_row + j0, o_row + j0, keep, stream);
        const int64_t j = j0 + done, n = chunk - done;
        if (n == 0) continue;
        if (draw.active) {
          dropout_factors<acc_t>(draw, r * d + j, n, factors);
          if (keep != nullptr) pack_keep_bits<acc_t>(factors, n, keep + done / 8);
        }
        combine<scalar_t, table_t, acc_t>(x_row + j, t_row + j, draw.active ? factors : nullptr,
                                          o_row + j, n, stream);
      }
    }
    if (stream) stream_fence();  // before this thread's part is handed back
  });
}

template <typename scalar_t, typename acc_t>
void add_position_backward_rows(const AddPositionArgs& g, const scalar_t* grad,
                                const int64_t* positions, const DropoutArgs& draw,
                                scalar_t* grad_x, acc_t* grad_table, scalar_t* grad_table_rounded) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  const int64_t d = g.d;

  // Masked gradient of n elements of row r from column j0 (a multiple of 8, as the saved
  // mask's byte reads need: column ranges start at multiples of 16, pieces at kChunk): written
  // to grad_x (if wanted) and added to acc (n accumulators). The mask is read from the saved
  // bits, or regenerated from the row's flat index. The fast paths (float32, AVX2) do whole
  // groups from the start in one pass (masked_saved_fast 8 elements, masked_fast 64); the
  // general path below does the rest (all of it elsewhere).
  // `start` > 0: elements [0, start) were done already (masked_saved_rows_fast).
  auto masked_row_into = [&](int64_t r, int64_t j0, int64_t n, acc_t* factors, acc_t* acc, int64_t start = 0) {
    const int64_t first = r * d + j0;
    int64_t done = start;
    if (done == 0) {
      done = grad_x != nullptr
          ? masked_saved_fast<true, true>(draw, d, r, j0, n, grad + first, grad_x + first, acc)
          : masked_saved_fast<false, true>(draw, d, r, j0, n, grad + first, grad_x, acc);
    }
    if (done == 0) {
      done = grad_x != nullptr
          ? masked_fast<true, true>(draw, first, n, grad + first, grad_x + first, acc)
          : masked_fast<false, true>(draw, first, n, grad + first, grad_x, acc);
    }
    if (done == n) return;
    if (draw.active) row_factors<acc_t>(draw, d, r, j0 + done, n - done, factors);
    for (int64_t k = done; k < n; k += W) {
      const int64_t m = std::min<int64_t>(W, n - k);
      Vec v = load_as<scalar_t, acc_t>(grad + first + k, m);
      if (draw.active) v = v * load_as<acc_t, acc_t>(factors + (k - done), m);
      if (grad_x != nullptr) store_as<scalar_t, acc_t>(v, grad_x + first + k, m);
      store_as<acc_t, acc_t>(load_as<acc_t, acc_t>(acc + k, m) + v, acc + k, m);
    }
  };
  auto row_of = [&](int64_t b, int64_t s) { return g.batch_first ? b * g.seq + s : s * g.batch + b; };

  if (positions == nullptr || g.positions_batch_stride == 0) {
    // The table row depends on s only: sum over the batch into accumulators of a block of
    // s (at most kAccElems values, 512 KiB of float32: L2-resident), then add each s once to
    // its row. Large blocks because, with batch_first, rows (b, s0..s1) are one contiguous
    // run of grad, and long runs are what the hardware prefetchers stream (the block sizes
    // measured: benchmarks/NOTES.md, CPU items 12 and 13). Without
    // positions the blocks are also capped at seq / threads rows, so that every thread gets
    // one.
    // Without positions (or with distinct ones) every s has its own row, so s blocks can be
    // split over threads; otherwise two s may share a row, so threads own columns. Each table
    // entry is summed in a fixed order (b ascending into acc, then s ascending into the
    // table): deterministic, whatever the loop order below. The loop order follows memory:
    // with batch_first, rows (b, s0..s1) are contiguous, so b is the outer loop.
    constexpr int64_t kAccElems = 131072;
    const bool unique = positions == nullptr || g.positions_distinct;
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t width = unique ? d : std::max<int64_t>(64, ((d + threads - 1) / threads + 15) / 16 * 16);
    const int64_t ranges = (d + width - 1) / width;
    // At most the rows there are (the accumulators are allocated per call).
    int64_t block_s = std::clamp<int64_t>(kAccElems / std::min(width, d), 1, std::max<int64_t>(1, g.seq));
    if (unique) block_s = std::min(block_s, std::max<int64_t>(1, (g.seq + threads - 1) / threads));
    const int64_t s_grain = unique ? block_s : g.seq;
    // A large call's grad_x (a fresh tensor) by streaming stores (masked_saved_rows_fast).
    const bool stream = grad_x != nullptr && g.batch * g.seq * d * static_cast<int64_t>(sizeof(scalar_t)) >= kStreamBytes;
    at::parallel_for(0, ranges * ((g.seq + s_grain - 1) / s_grain), 1, [&](int64_t begin, int64_t end) {
      alignas(64) acc_t factors[kChunk];
      // Uninitialised: each block of s zeroes the part it uses just below.
      const std::unique_ptr<acc_t[]> acc_buffer(new acc_t[static_cast<size_t>(block_s * std::min(width, d))]);
      acc_t* acc = acc_buffer.get();
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c = task % ranges;
        const int64_t j_begin = c * width;
        const int64_t j_end = std::min(d, j_begin + width);
        const int64_t wc = j_end - j_begin;
        const int64_t s_begin = (task / ranges) * s_grain;
        const int64_t s_end = std::min(g.seq, s_begin + s_grain);
        for (int64_t s0 = s_begin; s0 < s_end; s0 += block_s) {
          const int64_t s1 = std::min(s_end, s0 + block_s);
          std::fill(acc, acc + (s1 - s0) * wc, acc_t(0));
          auto add_row = [&](int64_t b, int64_t s) {
            for (int64_t j0 = j_begin; j0 < j_end; j0 += kChunk) {
              masked_row_into(row_of(b, s), j0, std::min(kChunk, j_end - j0), factors,
                              acc + (s - s0) * wc + (j0 - j_begin));
            }
          };
          if (g.batch_first) {
            // kBatchRows batch rows of one s at a time (masked_saved_rows_fast: one pass over
            // the accumulators for both), each row's remainder after it as before. Two: 0.81-0.93x
            // the time of one at a time; four and eight were slower than two (8: 1.5-1.75x: twice
            // as many concurrent streams of grad and grad_x; benchmarks/NOTES.md).
            constexpr int64_t kBatchRows = 2;
            for (int64_t b = 0; b < g.batch; b += kBatchRows) {
              const int64_t nb = std::min(kBatchRows, g.batch - b);
              for (int64_t s = s0; s < s1; ++s) {
                if (nb == 1) {
                  add_row(b, s);
                  continue;
                }
                int64_t rows[kBatchRows];
                for (int64_t i = 0; i < nb; ++i) rows[i] = row_of(b + i, s);
                for (int64_t j0 = j_begin; j0 < j_end; j0 += kChunk) {
                  const int64_t n = std::min(kChunk, j_end - j0);
                  acc_t* a = acc + (s - s0) * wc + (j0 - j_begin);
                  const int64_t done = masked_saved_rows_fast(draw, d, rows, nb, j0, n, grad, grad_x, a, stream);
                  for (int64_t i = 0; i < nb; ++i) {
                    if (done < n || done == 0) masked_row_into(rows[i], j0, n, factors, a, done);
                  }
                }
              }
            }
          } else {
            for (int64_t s = s0; s < s1; ++s)
              for (int64_t b = 0; b < g.batch; ++b) add_row(b, s);
          }
          for (int64_t s = s0; s < s1; ++s) {
            const acc_t* a_row = acc + (s - s0) * wc;
            if (unique) {
              // Row offset + s (positions[s]) is this sum alone (wc == d): written, not
              // added, in grad's dtype when asked (one rounding, as a conversion of the
              // float32 row).
              const int64_t row = (positions != nullptr ? positions[s] - g.table_row_base : g.offset + s) * d;
              if (grad_table_rounded == nullptr) {
                std::copy(a_row, a_row + d, grad_table + row);
                continue;
              }
              for (int64_t k = 0; k < d; k += W) {
                const int64_t m = std::min<int64_t>(W, d - k);
                store_as<scalar_t, acc_t>(load_as<acc_t, acc_t>(a_row + k, m), grad_table_rounded + row + k, m);
              }
              continue;
            }
            acc_t* t_row = grad_table + (positions[s] - g.table_row_base) * d + j_begin;
            for (int64_t k = 0; k < wc; ++k) t_row[k] += a_row[k];
          }
        }
      }
      if (stream) stream_fence();  // before this thread's part is handed back
    });
    return;
  }

  // (B, S) positions: any two rows may share a table row. Threads own column ranges and
  // walk the rows in order, accumulating straight into the table: deterministic.
  const int64_t rows = g.batch * g.seq;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t width = std::max<int64_t>(64, ((d + threads - 1) / threads + 15) / 16 * 16);
  const int64_t ranges = (d + width - 1) / width;
  at::parallel_for(0, ranges, 1, [&](int64_t begin, int64_t end) {
    alignas(64) acc_t factors[kChunk];
    for (int64_t c = begin; c < end; ++c) {
      const int64_t j_end = std::min(d, (c + 1) * width);
      for (int64_t j0 = c * width; j0 < j_end; j0 += kChunk) {
        const int64_t n = std::min(kChunk, j_end - j0);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t row = row_position(g, positions, r) - g.table_row_base;
          masked_row_into(r, j0, n, factors, grad_table + row * d + j0);
        }
      }
    }
  });
}

// grad * mask * scale in pieces of up to kChunk elements. With the saved mask the pieces
// are (row, columns) ones, since the mask's rows start on byte boundaries; without it the
// regenerated mask depends on the flat index only, so the whole tensor is one "row" and
// short rows do not cut the pieces (and masked_fast's 64-element groups) short. Either way
// each element gets the same factor and one rounded product.
template <typename scalar_t>
void dropout_backward(const scalar_t* grad, int64_t rows, int64_t d, const DropoutArgs& draw,
                      scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  const bool saved = draw.keep_bits != nullptr;
  const int64_t row_len = saved ? d : rows * d;
  const int64_t walk_rows = saved ? rows : 1;
  if (row_len == 0 || walk_rows == 0) return;
  const int64_t pieces_per_row = (row_len + kChunk - 1) / kChunk;
  const int64_t grain = std::max<int64_t>(1, 16 * kChunk / std::min(row_len, kChunk));
  at::parallel_for(0, walk_rows * pieces_per_row, grain, [&](int64_t begin, int64_t end) {
    alignas(64) acc_t factors[kChunk];
    for (int64_t piece = begin; piece < end; ++piece) {
      const int64_t r = piece / pieces_per_row;
      const int64_t j = (piece - r * pieces_per_row) * kChunk;
      const int64_t m = std::min(kChunk, row_len - j);
      const int64_t first = r * row_len + j;
      int64_t done =
          saved ? masked_saved_fast<true, false, scalar_t, acc_t>(draw, row_len, r, j, m, grad + first,
                                                                  out + first, nullptr)
                : masked_fast<true, false, scalar_t, acc_t>(draw, first, m, grad + first, out + first,
                                                            nullptr);
      if (done == 0 && !saved) {
        done = dropout_fast<scalar_t, scalar_t>(draw, first, m, grad + first, nullptr, out + first, nullptr);
      }
      if (done == m) continue;
      row_factors<acc_t>(draw, row_len, r, j + done, m - done, factors);
      combine<scalar_t, scalar_t, acc_t>(grad + first + done, nullptr, factors, out + first + done,
                                         m - done);
    }
  });
}

#define POSENC_INSTANTIATE(scalar_t, table_t)                                              \
  template void add_position_rows<scalar_t, table_t>(const AddPositionArgs&,            \
                                                     const scalar_t*, const table_t*,       \
                                                     const int64_t*, const DropoutArgs&,    \
                                                     scalar_t*);
POSENC_INSTANTIATE(float, float)
POSENC_INSTANTIATE(double, double)
POSENC_INSTANTIATE(double, float)
POSENC_INSTANTIATE(c10::Half, c10::Half)
POSENC_INSTANTIATE(c10::Half, float)
POSENC_INSTANTIATE(c10::BFloat16, c10::BFloat16)
POSENC_INSTANTIATE(c10::BFloat16, float)
#undef POSENC_INSTANTIATE

#define POSENC_INSTANTIATE_BACKWARD(scalar_t, acc_t)                                      \
  template void add_position_backward_rows<scalar_t, acc_t>(                                \
      const AddPositionArgs&, const scalar_t*, const int64_t*, const DropoutArgs&,       \
      scalar_t*, acc_t*, scalar_t*);
POSENC_INSTANTIATE_BACKWARD(float, float)
POSENC_INSTANTIATE_BACKWARD(double, double)
POSENC_INSTANTIATE_BACKWARD(c10::Half, float)
POSENC_INSTANTIATE_BACKWARD(c10::BFloat16, float)
#undef POSENC_INSTANTIATE_BACKWARD

template void dropout_backward<float>(const float*, int64_t, int64_t,
                                          const DropoutArgs&, float*);
template void dropout_backward<double>(const double*, int64_t, int64_t,
                                          const DropoutArgs&, double*);
template void dropout_backward<c10::Half>(const c10::Half*, int64_t, int64_t,
                                          const DropoutArgs&, c10::Half*);
template void dropout_backward<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t,
                                          const DropoutArgs&, c10::BFloat16*);

namespace {

void add_position_forward_kernel(const AddPositionArgs& g, c10::ScalarType dtype,
                                 bool wide_table, const void* x, const void* table,
                                 const int64_t* positions, const DropoutArgs& draw, void* out) {
  dispatch_floating(dtype, "posenc_add_position_cpu", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    using wide_t = at::opmath_type<scalar_t>;
    const auto* xs = static_cast<const scalar_t*>(x);
    auto* os = static_cast<scalar_t*>(out);
    if (wide_table) {
      add_position_rows<scalar_t, wide_t>(g, xs, static_cast<const wide_t*>(table), positions,
                                          draw, os);
    } else {
      add_position_rows<scalar_t, scalar_t>(g, xs, static_cast<const scalar_t*>(table),
                                            positions, draw, os);
    }
  });
}

void add_position_backward_kernel(const AddPositionArgs& g, c10::ScalarType dtype,
                                  const void* grad, const int64_t* positions,
                                  const DropoutArgs& draw, void* grad_x, void* grad_table,
                                  bool table_in_grad_dtype) {
  dispatch_floating(dtype, "posenc_add_position_backward_table_cpu", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    using acc_t = at::opmath_type<scalar_t>;
    add_position_backward_rows<scalar_t, acc_t>(
        g, static_cast<const scalar_t*>(grad), positions, draw, static_cast<scalar_t*>(grad_x),
        table_in_grad_dtype ? nullptr : static_cast<acc_t*>(grad_table),
        table_in_grad_dtype ? static_cast<scalar_t*>(grad_table) : nullptr);
  });
}

void dropout_backward_kernel(c10::ScalarType dtype, const void* grad, int64_t rows, int64_t d,
                             const DropoutArgs& draw, void* out) {
  dispatch_floating(dtype, "posenc_add_position_backward_cpu", [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    dropout_backward<scalar_t>(static_cast<const scalar_t*>(grad), rows, d, draw,
                               static_cast<scalar_t*>(out));
  });
}

}  // namespace

POSENC_ISA_NAMESPACE_END

POSENC_REGISTER_DISPATCH(add_position_forward_stub, &add_position_forward_kernel)
POSENC_REGISTER_DISPATCH(add_position_backward_stub, &add_position_backward_kernel)
POSENC_REGISTER_DISPATCH(dropout_backward_stub, &dropout_backward_kernel)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
