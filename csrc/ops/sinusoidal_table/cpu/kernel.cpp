// CPU kernel of sinusoidal_table. Every entry is libm's float64 sin or cos of the float64
// angle p * f_j, rounded once to the table's dtype: a float64 table evaluates exactly that,
// one sincos per column pair.
//
// A float32, bfloat16 or float16 table of positions p0, p0 + s, p0 + 2s, ... (integers: a
// module's table, arange) gets the same bits for a fraction of the cost. Along the rows, the
// pair (cos, sin) of column pair i turns by the same angle s f_i from one row to the next, a
// complex product of four float64 multiplies, and a libm sincos starts each run of kRun rows
// afresh. The product's result differs from libm's value at the rounded angle by at most
// the bound E below (libm's error, the angle's rounding, each product's rounding and its
// step's error, doubled). Both ends of [v - E, v + E] are rounded to float32; where they
// agree, libm's value, which lies between them, rounds to the same float32 (rounding is
// monotonic), and a narrow dtype is rounded from that float32 as ATen's cast rounds. Where
// they do not (a value within E of a rounding boundary: about 3 values in 10^4 of a module's
// table, more at huge positions), that column pair is evaluated by libm as in the float64
// table. So the table holds what libm rounded gives, bit for bit, on every ISA build.
// (16384, 512) float32, 2 threads: 34 ms by libm per entry, 1.4 ms so (benchmarks/NOTES.md).
#include "ops/sinusoidal_table/cpu/kernel.h"

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "ops/common/cpu/half_lanes.h"  // bf16_round_bits, bf16_round_bits_512, kStreamBytes (cpu_support.h), stream_fence

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace {

// libm's value rounded to T as the float64 table's ATen cast rounds it (a narrow T through
// float32: ATen's float64 -> bfloat16 / float16 casts go through float32).
template <typename T>
T round_to(double v) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    return static_cast<T>(v);
  } else {
    return T(static_cast<float>(v));
  }
}

template <typename T>
bool same_bits(T x, T y) {
  return std::memcmp(&x, &y, sizeof(T)) == 0;
}

// The float64 table's rows [first, last): libm per column pair.
template <typename T>
void libm_rows(const SinusoidalTableArgs& a, int64_t first, int64_t last) {
  const int64_t d = a.d_model;
  for (int64_t r = first; r < last; ++r) {
    T* row = static_cast<T*>(a.out) + r * d;
    const double p = a.positions[r];
    int64_t j = 0;
    for (; j + 1 < d; j += 2) {
      const double angle = p * a.freq[j];  // the pair's frequency (columns 2i and 2i + 1)
      row[j] = round_to<T>(std::sin(angle));
      row[j + 1] = round_to<T>(std::cos(angle));
    }
    if (j < d) row[j] = round_to<T>(std::sin(p * a.freq[j]));  // odd d: a last sine column
  }
}

// Column pair i of row r by libm (the fallback of an uncertain group).
template <typename T>
void libm_pair(const SinusoidalTableArgs& a, int64_t r, int64_t i) {
  const int64_t d = a.d_model;
  T* row = static_cast<T*>(a.out) + r * d;
  const double angle = a.positions[r] * a.freq[2 * i];
  row[2 * i] = round_to<T>(std::sin(angle));
  if (2 * i + 1 < d) row[2 * i + 1] = round_to<T>(std::cos(angle));
}

// True when every position is an integer of magnitude <= 2^40 and consecutive positions
// differ by one step: then p[r] + k * step is exactly p[r + k], and every angle's rounding
// is bounded by the largest magnitude, *pmax.
bool integer_progression(const double* p, int64_t n, double* step, double* pmax) {
  if (n < 2) return false;
  const double s = p[1] - p[0];
  for (int64_t r = 0; r < n; ++r) {
    if (!(std::fabs(p[r]) <= 0x1p40) || p[r] != std::trunc(p[r])) return false;
    if (r > 0 && p[r] - p[r - 1] != s) return false;
  }
  *step = s;
  *pmax = std::max(std::fabs(p[0]), std::fabs(p[n - 1]));
  return true;
}

constexpr int64_t kRun = 1024;  // rows per libm anchor

// E(k, f) = a + da k + f (b + db k): how far the product's value after k steps from the
// anchor can be from libm's value at the rounded angle, for a column of frequency f <= 1.
// Absolute errors, for values of magnitude <= 1.01:
// - libm's sin / cos: <= 1 ulp (glibc), taken as 2^-52 (2 ulps at magnitudes below 1); a
//   libm with a larger worst-case error (not glibc's) needs a larger `lib` here, or the
//   check could accept a value that rounds differently from that libm's;
// - an angle p f rounded to float64: <= |p| f 2^-53 (and sin, cos are 1-Lipschitz);
// - the reference: libm at the rounded angle: lib + pmax f 2^-53;
// - the anchor, libm's (cos, sin) at its own rounded angle: sqrt 2 (lib + pmax f 2^-53);
// - each step: the product with libm's (cos, sin) of the step's rounded angle s f,
//   |z| sqrt 2 (lib + |s| f 2^-53) <= 1.5 (lib + |s| f 2^-53), plus the product's own
//   rounding (three roundings per component): <= 2^-50.
// Every term doubled, which also covers rounding v -+ E itself (<= 2^-54) and E's own
// rounding as it is summed step by step.
struct Bound {
  double a, da, b, db;
};
Bound error_bound(double step, double pmax) {
  constexpr double lib = 0x1p-52, rnd = 0x1p-50, angle = 0x1p-53;
  return {2.0 * (1.0 + 1.5) * lib, 2.0 * (1.5 * lib + rnd), 2.0 * angle * (1.0 + 1.5) * pmax,
          2.0 * angle * 1.5 * std::fabs(step)};
}

// The steps shared by every row: each column pair's frequency w and libm's (cos, sin) of
// its step angle, sr and si.
struct Steps {
  const double *w, *sr, *si;
  Bound bound;
};

// Column pair i of a row from the product (c, s) and the bound e: both columns if both round
// alike at both ends of their intervals (false otherwise, and nothing is written).
template <typename T>
bool certain_pair(T* row, int64_t d, int64_t i, double c, double s, double e) {
  const T s_lo = round_to<T>(s - e), s_hi = round_to<T>(s + e);
  if (!same_bits(s_lo, s_hi)) return false;
  if (2 * i + 1 < d) {
    const T c_lo = round_to<T>(c - e), c_hi = round_to<T>(c + e);
    if (!same_bits(c_lo, c_hi)) return false;
    row[2 * i + 1] = c_lo;
  }
  row[2 * i] = s_lo;
  return true;
}

// Column pair i of rows [run, run + n): libm's anchor at row run, then one step per row.
template <typename T>
void sweep_pair(const SinusoidalTableArgs& a, const Steps& st, int64_t run, int64_t n, int64_t i) {
  const int64_t d = a.d_model;
  const double angle = a.positions[run] * st.w[i];
  double zr = std::cos(angle), zi = std::sin(angle);
  const double e0 = st.bound.a + st.w[i] * st.bound.b, de = st.bound.da + st.w[i] * st.bound.db;
  for (int64_t k = 0; k < n; ++k) {
    if (!certain_pair<T>(static_cast<T*>(a.out) + (run + k) * d, d, i, zr, zi, e0 + de * k)) {
      libm_pair<T>(a, run + k, i);
    }
    const double re = zr;
    zr = re * st.sr[i] - zi * st.si[i];
    zi = re * st.si[i] + zi * st.sr[i];
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// 8 float32 values to T's bits (float32 as they are), as c10's conversions round (nearest
// even; the values are finite).
template <typename T>
__m128i narrow8(__m256 x) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m256i rounded = bf16_round_bits(x);  // finite values: no NaN lanes
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  }
}

// 4 column pairs (8 columns) of one row from z = (re, im) and the bound e, written either way;
// returns the pairs (bit q: pair q) with a value whose two ends round to different float32
// values (a narrow T is rounded from float32, so a value certain in float32 is certain in T).
template <typename T>
int store_quad(T* out, __m256d re, __m256d im, __m256d e) {
  const __m128 s_lo = _mm256_cvtpd_ps(_mm256_sub_pd(im, e)), s_hi = _mm256_cvtpd_ps(_mm256_add_pd(im, e));
  const __m128 c_lo = _mm256_cvtpd_ps(_mm256_sub_pd(re, e)), c_hi = _mm256_cvtpd_ps(_mm256_add_pd(re, e));
  // (sin, cos) of each pair in column order
  const __m256 lo = _mm256_set_m128(_mm_unpackhi_ps(s_lo, c_lo), _mm_unpacklo_ps(s_lo, c_lo));
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(out, lo);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), narrow8<T>(lo));
  }
  const __m128i diff = _mm_castps_si128(_mm_or_ps(_mm_xor_ps(s_lo, s_hi), _mm_xor_ps(c_lo, c_hi)));
  if (_mm_testz_si128(diff, diff)) return 0;
  return ~_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(diff, _mm_setzero_si128()))) & 0xf;
}

// The (cos, sin) of column pairs [i, i + 8) at row `run` by libm (a run's anchor) into zr
// and zi, and the highest of their frequencies (whose bound serves the 8).
inline double anchor_octet(const SinusoidalTableArgs& a, const Steps& st, int64_t run, int64_t i, double* zr,
                           double* zi) {
  const double p = a.positions[run];
  double w_max = 0.0;
  for (int64_t q = 0; q < 8; ++q) {
    const double angle = p * st.w[i + q];
    zi[q] = std::sin(angle);
    zr[q] = std::cos(angle);
    w_max = std::max(w_max, st.w[i + q]);
  }
  return w_max;
}

// Column pairs [i, i + 8) of rows [run, run + n), z in registers: two independent products
// per row hide each other's latency. One bound for the 8 pairs, that of the highest
// frequency among them (pair i's: the frequencies fall along the columns).
template <typename T>
void sweep_octet(const SinusoidalTableArgs& a, const Steps& st, int64_t run, int64_t n, int64_t i) {
  const int64_t d = a.d_model;
  alignas(32) double zr0[8], zi0[8];
  const double w_max = anchor_octet(a, st, run, i, zr0, zi0);
  __m256d re0 = _mm256_load_pd(zr0), im0 = _mm256_load_pd(zi0);
  __m256d re1 = _mm256_load_pd(zr0 + 4), im1 = _mm256_load_pd(zi0 + 4);
  const __m256d sr0 = _mm256_loadu_pd(st.sr + i), si0 = _mm256_loadu_pd(st.si + i);
  const __m256d sr1 = _mm256_loadu_pd(st.sr + i + 4), si1 = _mm256_loadu_pd(st.si + i + 4);
  __m256d e = _mm256_set1_pd(st.bound.a + w_max * st.bound.b);
  const __m256d de = _mm256_set1_pd(st.bound.da + w_max * st.bound.db);
  T* out = static_cast<T*>(a.out) + run * d + 2 * i;
  for (int64_t k = 0; k < n; ++k, out += d) {
    int uncertain = store_quad<T>(out, re0, im0, e) | (store_quad<T>(out + 8, re1, im1, e) << 4);
    for (; uncertain != 0; uncertain &= uncertain - 1) libm_pair<T>(a, run + k, i + __builtin_ctz(uncertain));
    const __m256d r0 = re0, r1 = re1;
    re0 = _mm256_sub_pd(_mm256_mul_pd(r0, sr0), _mm256_mul_pd(im0, si0));
    im0 = _mm256_add_pd(_mm256_mul_pd(r0, si0), _mm256_mul_pd(im0, sr0));
    re1 = _mm256_sub_pd(_mm256_mul_pd(r1, sr1), _mm256_mul_pd(im1, si1));
    im1 = _mm256_add_pd(_mm256_mul_pd(r1, si1), _mm256_mul_pd(im1, sr1));
    e = _mm256_add_pd(e, de);
  }
}

POSENC_AVX512_WARNINGS_BEGIN
// sweep_octet's state with the 8 pairs in one 512-bit register each for cos and sin: the
// same products, bounds and roundings (so the same values), in a third of the instructions.
struct Octet512 {
  __m512d re, im, sr, si, e, de;
};

POSENC_AVX512_TARGET inline Octet512 octet512_at(const SinusoidalTableArgs& a, const Steps& st, int64_t run,
                                                 int64_t i) {
  alignas(64) double zr0[8], zi0[8];
  const double w_max = anchor_octet(a, st, run, i, zr0, zi0);
  return {_mm512_load_pd(zr0), _mm512_load_pd(zi0), _mm512_loadu_pd(st.sr + i), _mm512_loadu_pd(st.si + i),
          _mm512_set1_pd(st.bound.a + w_max * st.bound.b), _mm512_set1_pd(st.bound.da + w_max * st.bound.db)};
}

// One row of an octet: its 16 values (sin, cos) in column order as float32, and the mask of
// its pairs whose value the bound leaves uncertain (bit q: pair q); then the octet steps on.
POSENC_AVX512_TARGET __attribute__((always_inline)) inline __m512 octet512_row(Octet512& o, unsigned& uncertain) {
  // lanes 0..7 of the sines, 16..23 of the cosines
  const __m512i order = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m256 s_lo = _mm512_cvtpd_ps(_mm512_sub_pd(o.im, o.e)), s_hi = _mm512_cvtpd_ps(_mm512_add_pd(o.im, o.e));
  const __m256 c_lo = _mm512_cvtpd_ps(_mm512_sub_pd(o.re, o.e)), c_hi = _mm512_cvtpd_ps(_mm512_add_pd(o.re, o.e));
  uncertain = _mm256_cmpneq_epi32_mask(_mm256_castps_si256(s_lo), _mm256_castps_si256(s_hi)) |
              _mm256_cmpneq_epi32_mask(_mm256_castps_si256(c_lo), _mm256_castps_si256(c_hi));
  const __m512d r = o.re;
  o.re = _mm512_sub_pd(_mm512_mul_pd(r, o.sr), _mm512_mul_pd(o.im, o.si));
  o.im = _mm512_add_pd(_mm512_mul_pd(r, o.si), _mm512_mul_pd(o.im, o.sr));
  o.e = _mm512_add_pd(o.e, o.de);
  return _mm512_permutex2var_ps(_mm512_castps256_ps512(s_lo), order, _mm512_castps256_ps512(c_lo));
}

// 16 table values in a narrow dtype (float16: to nearest even; bfloat16:
// c10::round_to_nearest_even, the table holding no NaN).
template <typename T>
POSENC_AVX512_TARGET __attribute__((always_inline)) inline __m256i narrow_table16(__m512 v) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    return _mm512_cvtepi32_epi16(bf16_round_bits_512(v));
  }
}

// Column pairs [i, i + 8) of rows [run, run + n): sweep_octet in 512-bit registers.
template <typename T>
POSENC_AVX512_TARGET void sweep_octet_avx512(const SinusoidalTableArgs& a, const Steps& st, int64_t run, int64_t n,
                                             int64_t i) {
  const int64_t d = a.d_model;
  Octet512 o = octet512_at(a, st, run, i);
  T* out = static_cast<T*>(a.out) + run * d + 2 * i;
  for (int64_t k = 0; k < n; ++k, out += d) {
    unsigned uncertain = 0;
    const __m512 v = octet512_row(o, uncertain);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(out, v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), narrow_table16<T>(v));
    }
    for (; uncertain != 0; uncertain &= uncertain - 1) libm_pair<T>(a, run + k, i + __builtin_ctz(uncertain));
  }
}

// Column pairs [i, i + 16) of rows [run, run + n): two octets of sweep_octet_avx512, the same
// products, bounds and values, as two independent products per row (each hides the other's
// latency), and with `stream` each row's 32 columns (64 bytes of a narrow dtype, 128 of
// float32: whole 64-byte lines) written by streaming stores, which do not read the lines they
// overwrite: a table of kStreamBytes or more is written once, not read first. The libm
// values of uncertain pairs replace theirs after the sweep (below).
template <typename T>
POSENC_AVX512_TARGET void sweep_two_octets_avx512(const SinusoidalTableArgs& a, const Steps& st, int64_t run,
                                                  int64_t n, int64_t i, bool stream) {
  const int64_t d = a.d_model;
  Octet512 o[2] = {octet512_at(a, st, run, i), octet512_at(a, st, run, i + 8)};
  T* out = static_cast<T*>(a.out) + run * d + 2 * i;
  uint16_t uncertain_rows[kRun];  // bit q: pair i + q of row run + k is uncertain
  for (int64_t k = 0; k < n; ++k, out += d) {
    unsigned uncertain[2];
    const __m512 v[2] = {octet512_row(o[0], uncertain[0]), octet512_row(o[1], uncertain[1])};
    uncertain_rows[k] = static_cast<uint16_t>(uncertain[0] | (uncertain[1] << 8));
    // The 32 columns in T as whole lines, in registers.
    constexpr int kLines = static_cast<int>(32 * sizeof(T) / 64);
    __m512i line[kLines];
    if constexpr (std::is_same_v<T, float>) {
      line[0] = _mm512_castps_si512(v[0]);
      line[1] = _mm512_castps_si512(v[1]);
    } else {
      line[0] = _mm512_inserti64x4(_mm512_castsi256_si512(narrow_table16<T>(v[0])), narrow_table16<T>(v[1]), 1);
    }
    for (int l = 0; l < kLines; ++l) {
      if (stream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(reinterpret_cast<char*>(out) + 64 * l), line[l]);
      } else {
        _mm512_storeu_si512(reinterpret_cast<char*>(out) + 64 * l, line[l]);
      }
    }
  }
  // libm's values of the uncertain pairs (about 3 in 10^4), after the loop: no call in it
  // (a call clobbers every vector register: the loop's state would live on the stack), and
  // written after a fence, which orders the streaming stores before these plain ones (and
  // before the thread's part is handed back: every streaming store is fenced here).
  if (stream) stream_fence();
  for (int64_t k = 0; k < n; ++k) {
    for (unsigned u = uncertain_rows[k]; u != 0; u &= u - 1) libm_pair<T>(a, run + k, i + __builtin_ctz(u));
  }
}
POSENC_AVX512_WARNINGS_END
#endif

// Rows [first, last) of a table of float32 or narrower from the recurrence, run by run, and
// in a run 16 column pairs at a time down its rows where AVX-512 runs (whole 64-byte lines:
// sweep_two_octets_avx512), else 8 (float32: whole lines; a narrow dtype's half lines wait
// in the cache, 32 bytes per row of the run, for the next 8 pairs); then pair by pair.
template <typename T>
void progression_rows(const SinusoidalTableArgs& a, const Steps& st, int64_t first, int64_t last, bool stream) {
  const int64_t pairs = (a.d_model + 1) / 2;
  for (int64_t run = first; run < last; run += kRun) {
    const int64_t n = std::min(last, run + kRun) - run;
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
    const bool avx512 = cpu_has_avx512();
    if (avx512) {
      for (const int64_t full = a.d_model / 2; i + 16 <= full; i += 16) {
        sweep_two_octets_avx512<T>(a, st, run, n, i, stream);
      }
    }
    for (const int64_t full = a.d_model / 2; i + 8 <= full; i += 8) {
      if (avx512) {
        sweep_octet_avx512<T>(a, st, run, n, i);
      } else {
        sweep_octet<T>(a, st, run, n, i);
      }
    }
#endif
    for (; i < pairs; ++i) sweep_pair<T>(a, st, run, n, i);
  }
}

// A narrow table of an integer progression (step, the largest |position| pmax) from the
// recurrence.
template <typename T>
void progression_table(const SinusoidalTableArgs& a, double step, double pmax, int64_t grain) {
  const int64_t d = a.d_model;
  const int64_t pairs = (d + 1) / 2;
  const c10::DataPtr storage = c10::GetCPUAllocator()->allocate(3 * pairs * sizeof(double));
  double* w = static_cast<double*>(storage.get());
  double *sr = w + pairs, *si = sr + pairs;
  for (int64_t i = 0; i < pairs; ++i) {
    w[i] = a.freq[2 * i];
    const double angle = step * w[i];
    si[i] = std::sin(angle);
    sr[i] = std::cos(angle);
  }
  const Steps st{w, sr, si, error_bound(step, pmax)};
  // Whole runs per task where there are enough rows.
  const int64_t runs_grain = a.rows >= 2 * kRun ? kRun : std::max<int64_t>(grain, 64);
  // Streaming stores (sweep_two_octets_avx512) for a table of kStreamBytes or more whose rows
  // are whole 64-byte lines from a 64-byte aligned start, so that every 16 pairs of a row are.
  const bool stream = a.rows * d * static_cast<int64_t>(sizeof(T)) >= kStreamBytes &&
                      (d * static_cast<int64_t>(sizeof(T))) % 64 == 0 &&
                      reinterpret_cast<std::uintptr_t>(a.out) % 64 == 0;
  at::parallel_for(0, a.rows, runs_grain, [&](int64_t b, int64_t e) { progression_rows<T>(a, st, b, e, stream); });
}

template <typename T>
void table_rows(const SinusoidalTableArgs& a) {
  const int64_t grain = std::max<int64_t>(1, 16384 / a.d_model);
  double step = 0.0, pmax = 0.0;
  if constexpr (!std::is_same_v<T, double>) {  // the recurrence serves narrower tables only
    if (integer_progression(a.positions, a.rows, &step, &pmax)) {
      progression_table<T>(a, step, pmax, grain);
      return;
    }
  }
  at::parallel_for(0, a.rows, grain, [&](int64_t b, int64_t e) { libm_rows<T>(a, b, e); });
}

void sinusoidal_table_kernel(const SinusoidalTableArgs& a, c10::ScalarType dtype) {
  dispatch_floating(dtype, "posenc_sinusoidal_table_cpu", [&](auto* tag) {
    table_rows<std::remove_pointer_t<decltype(tag)>>(a);
  });
}

}  // namespace
POSENC_ISA_NAMESPACE_END

POSENC_REGISTER_DISPATCH(sinusoidal_table_stub, &sinusoidal_table_kernel)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
