// Rotary position embedding (Su et al., RoFormer): the frequencies, the long-context scaling
// rules and the rotation angle, shared by the CPU and the CUDA kernels.
//
// Pair i of a head (i < rotary_dim / 2) turns by the angle pos * inv_freq[i], where
//   inv_freq[i] = base^(-2i / rotary_dim)
// before scaling. The scaling rules follow Hugging Face transformers' rope initialisation
// functions (modeling_rope_utils.py) for the types linear, dynamic, yarn and llama3; they are
// evaluated in double precision (transformers rounds to float32, a difference of < 1 ulp of
// float32 in the frequencies).
//
// Accuracy of the angle: a float32 product pos * inv_freq is off by up to ~0.06 rad at
// pos = 1e6 (the float32 rounding of inv_freq alone is a relative 6e-8). Here the product
// is formed in double, reduced modulo pi/2 in double (Cody-Waite, two-part pi/2), and only
// the reduced angle in [-pi/4, pi/4] is rounded to the working precision.
#pragma once

#include <cmath>
#include <cstdint>

#include "posenc/math/host_device.h"

namespace posenc {
namespace math {

// The keys of Hugging Face's `rope_scaling` dict that posenc reads, in the order of the
// rope op's float[] `scaling` argument: the one list that RopeScaling's fields, the op's
// parser and error messages, the C++ API's RopeScaling::values() and Python's key list
// (torch.ops.posenc.rope_scaling_spec) come from. Which type reads which key is the keys
// column of POSENC_ROPE_TYPES (below); defaults: yarn's beta_fast 32, beta_slow 1,
// attention_factor from mscale, truncate true (nonzero is true); proportional's
// partial_rotary_factor (the share of pairs that turn) 1 and factor 1.
#define POSENC_ROPE_SCALING_KEYS(X)  \
  X(factor)                          \
  X(low_freq_factor)                 \
  X(high_freq_factor)                \
  X(original_max_position_embeddings) \
  X(beta_fast)                       \
  X(beta_slow)                       \
  X(attention_factor)                \
  X(mscale)                          \
  X(mscale_all_dim)                  \
  X(truncate)                        \
  X(partial_rotary_factor)

// Most rotary pairs per head: rotary_dim <= 512.
constexpr int kRopeMaxPairs = 256;

// Each key of POSENC_ROPE_SCALING_KEYS by its index: bit i of RopeScalingParams::given.
enum class RopeKey : int {
#define POSENC_X(key) key,
  POSENC_ROPE_SCALING_KEYS(POSENC_X)
#undef POSENC_X
};

// Bit k of a key mask (RopeScalingParams::given, a type's keys in POSENC_ROPE_TYPES).
inline constexpr uint32_t rope_key_bit(RopeKey k) { return uint32_t{1} << static_cast<int>(k); }

// What a scaling type is besides its formula (rope_inv_freq): bit flags that every front end
// (the C++ API and module; Python through rope_scaling_spec, by the names here) reads from
// the table below instead of naming types. X(flag, "name"); flag i is bit i.
//   scales_by_length     its frequencies depend on the call's length (longest position + 1,
//                        the op's seq_len): a front end passes seq_len=-1 (the op reads it
//                        from the call) or the length it knows, never 0.
//   list_keys            it reads the list keys (POSENC_ROPE_SCALING_LIST_KEYS), one value per
//                        rotary pair, appended to the op's float[] scaling.
//   original_from_model  original_max_position_embeddings, when not given, is the model's
//                        max_position_embeddings (transformers reads the config's; the
//                        modules' max_position_embeddings, default max_len;
//                        rope_cos_sin's max_position_embeddings).
//   factor_from_model    factor, when not given, is max_position_embeddings /
//                        original_max_position_embeddings (transformers' longrope; its yarn
//                        derives it only for a dict's factor of None, which a dict without
//                        the key would silently match: the integration reads that rule).
// (Which keys a type reads is its own column of POSENC_ROPE_TYPES: a type whose keys include
// partial_rotary_factor reads it as the share of pairs that turn, where for the others a
// config's partial_rotary_factor sets rotary_dim, Python's resolve_config_keys.)
#define POSENC_ROPE_TYPE_FACTS(X)                  \
  X(kRopeScalesByLength, "scales_by_length")       \
  X(kRopeListKeys, "list_keys")                    \
  X(kRopeOriginalFromModel, "original_from_model") \
  X(kRopeFactorFromModel, "factor_from_model")

enum RopeTypeFactBit : unsigned {
#define POSENC_X(flag, name) flag##Bit,
  POSENC_ROPE_TYPE_FACTS(POSENC_X)
#undef POSENC_X
};
#define POSENC_X(flag, name) constexpr unsigned flag = 1u << flag##Bit;
POSENC_ROPE_TYPE_FACTS(POSENC_X)
#undef POSENC_X

// The scaling types, their Hugging Face names, facts and keys: the one list that the op's
// parser, its error messages, Python's list of types and every front end's per-type
// behaviour come from (X(enumerator, "name", facts, keys)). `keys`: the scaling keys the
// type's formulas (rope_inv_freq, rope_attention_factor) read; a key given to a type that
// does not read it is refused by the op (ignored, it would be a scaling that silently does
// not happen) and dropped with a warning by Python's dict reader, as transformers ignores it.
#define POSENC_ROPE_KEY(k) rope_key_bit(RopeKey::k)
#define POSENC_ROPE_TYPES(X)                                                                                  \
  X(kDefault, "default", 0u, 0u)                                                                              \
  X(kLinear, "linear", 0u, POSENC_ROPE_KEY(factor))                                                           \
  X(kDynamic, "dynamic", kRopeScalesByLength | kRopeOriginalFromModel,                                        \
    POSENC_ROPE_KEY(factor) | POSENC_ROPE_KEY(original_max_position_embeddings))                              \
  X(kYarn, "yarn", kRopeOriginalFromModel,                                                                    \
    POSENC_ROPE_KEY(factor) | POSENC_ROPE_KEY(original_max_position_embeddings) | POSENC_ROPE_KEY(beta_fast) | \
        POSENC_ROPE_KEY(beta_slow) | POSENC_ROPE_KEY(attention_factor) | POSENC_ROPE_KEY(mscale) |           \
        POSENC_ROPE_KEY(mscale_all_dim) | POSENC_ROPE_KEY(truncate))                                          \
  X(kLlama3, "llama3", 0u,                                                                                    \
    POSENC_ROPE_KEY(factor) | POSENC_ROPE_KEY(low_freq_factor) | POSENC_ROPE_KEY(high_freq_factor) |         \
        POSENC_ROPE_KEY(original_max_position_embeddings))                                                    \
  X(kLongrope, "longrope", kRopeScalesByLength | kRopeListKeys | kRopeFactorFromModel,                        \
    POSENC_ROPE_KEY(factor) | POSENC_ROPE_KEY(original_max_position_embeddings) |                             \
        POSENC_ROPE_KEY(attention_factor))                                                                    \
  X(kProportional, "proportional", 0u,                                                                        \
    POSENC_ROPE_KEY(factor) | POSENC_ROPE_KEY(partial_rotary_factor))

enum class RopeType : int {
#define POSENC_X(e, name, facts, keys) e,
  POSENC_ROPE_TYPES(POSENC_X)
#undef POSENC_X
};

// The list-valued keys (longrope: Phi-3, Phi-3.5, Phi-4-mini), one value per rotary pair:
// appended to the op's float[] `scaling` after the keys above, in this order, each
// rotary_dim / 2 long. short_factor divides the frequencies while the longest position + 1
// is at most original_max_position_embeddings, long_factor beyond.
#define POSENC_ROPE_SCALING_LIST_KEYS(X) \
  X(short_factor)                        \
  X(long_factor)

// The parameters of a `rope_scaling` dict, one field per key. Presence travels beside the
// values: bit i of `given` says that key RopeKey(i) was in the dict (its field holds the
// value); a key not given reads as 0 and its default, where it has one, applies. No value
// means "not given", so any value a caller sets is checked as a value.
struct RopeScalingParams {
  RopeType type = RopeType::kDefault;
  uint32_t given = 0;
#define POSENC_X(key) double key = 0.0;
  POSENC_ROPE_SCALING_KEYS(POSENC_X)
#undef POSENC_X
  int64_t list_length = 0;  // values per list key (0: none given)
#define POSENC_X(key) double key[kRopeMaxPairs] = {};
  POSENC_ROPE_SCALING_LIST_KEYS(POSENC_X)
#undef POSENC_X
};


// The plain settings of a RoPE call, each declared once, here: X(C++ type, name, default,
// schema type). From this line follow the op's schema argument (appended to the RoPE ops'
// shared schema tail, ops/common/rope_call.cpp), the field of RopeSettings (read by the
// checks, the kernels and the ATen composites through the functions below), the field of
// the C++ options (ApplyRopeOptions and RotaryPositionalEncodingOptions, posenc/rope.h)
// and Python's keyword (python/posenc/_rope.py reads the schema). Integers and floats
// only (a schema default is the C++ default spelled as is).
#define POSENC_ROPE_SETTINGS(X)                                                           \
  /* The first rotated feature: features [rotary_offset, rotary_offset + rotary_dim)     */ \
  /* rotate, the others pass through (DeepSeek's [nope | rope] heads); rotary_dim then   */ \
  /* defaults to head_dim - rotary_offset.                                                */ \
  X(int64_t, rotary_offset, 0, "int")

// The values of POSENC_ROPE_SETTINGS for one call.
struct RopeSettings {
#define POSENC_X(type, name, default_value, schema_type) type name = default_value;
  POSENC_ROPE_SETTINGS(POSENC_X)
#undef POSENC_X
};

// Number of keys: the length of the op's float[] argument.
constexpr int kRopeScalingFields = 0
#define POSENC_X(key) +1
    POSENC_ROPE_SCALING_KEYS(POSENC_X)
#undef POSENC_X
    ;

POSENC_ISA_NAMESPACE_BEGIN

// True when the dict gave key k.
POSENC_HOST_DEVICE bool rope_has(const RopeScalingParams& s, RopeKey k) {
  return ((s.given >> static_cast<int>(k)) & 1u) != 0;
}

// The two features that pair p of a row rotates together: halves (p, p + half), as in
// GPT-NeoX and Hugging Face's rotate_half, or adjacent (2p, 2p + 1), as in GPT-J and Meta's
// LLaMA (interleaved). half = rotary_dim / 2.
POSENC_HOST_DEVICE void rope_pair_features(int64_t p, int64_t half, bool interleaved,
                                           int64_t* e1, int64_t* e2) {
  *e1 = interleaved ? 2 * p : p;
  *e2 = interleaved ? 2 * p + 1 : p + half;
}

// Where a head's rotary features start: features [begin, begin + rotary_dim) rotate, the
// others pass through. Every kernel and composite places its rotation with these.
POSENC_HOST_DEVICE int64_t rope_rotary_begin(const RopeSettings& s) { return s.rotary_offset; }

// The feature of pass-through index j (0 <= j < head_dim - rotary_dim): the features before
// the rotary part, then those after it.
POSENC_HOST_DEVICE int64_t rope_pass_feature(int64_t j, int64_t begin, int64_t rotary_dim) {
  return j < begin ? j : j + rotary_dim;
}

// The rotation of one pair, (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), rounded the same way on
// every path (vectorised or scalar, CPU or CUDA, any alignment or stride): each output is one
// rounded product and one fused multiply-add,
//   y1 = fma(x1, c, -(x2 * s)),   y2 = fma(x2, c, x1 * s).
// Written out because compilers contract x1 * c - x2 * s into FMAs differently per code
// path (nvcc per instantiation, gcc between its vector and scalar loops), which made results
// depend on the path by 1 ulp. The CPU vector loops spell the same two steps with
// at::vec::fmadd.
template <typename T>
POSENC_HOST_DEVICE T rope_mul_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 8) {
    return __dmul_rn(a, b);
  } else {
    return __fmul_rn(a, b);
  }
#else
  return a * b;  // a product alone is never contracted
#endif
}

// a * b + c rounded once, in T (std::fma's float overload on the host: the C ::fma is double).
template <typename T>
POSENC_HOST_DEVICE T rope_fma(T a, T b, T c) {
#if defined(__CUDA_ARCH__)
  return fma(a, b, c);  // CUDA's overloads: fmaf for float
#else
  return std::fma(a, b, c);
#endif
}

template <typename T>
POSENC_HOST_DEVICE void rope_rotate_pair(T x1, T x2, T c, T s, T* y1, T* y2) {
  *y1 = rope_fma(x1, c, -rope_mul_rn(x2, s));
  *y2 = rope_fma(x2, c, rope_mul_rn(x1, s));
}

// The rotation of one pair with given tables (apply_rope_cos_sin, Hugging Face's
// x * cos + rotate_half(x) * sin): feature e1 takes (c1, s1), e2 takes (c2, s2), which
// tables built as cat(freqs, freqs) make equal but which are read apart, as transformers
// does. transpose: the transposed map (the backward):
//   forward    y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
//   transpose  y1 = x1 c1 + x2 s2,   y2 = x2 c2 - x1 s1
// rounded as rope_rotate_pair (one product, one fma per output).
template <typename T>
POSENC_HOST_DEVICE void rope_rotate_pair_tables(T x1, T x2, T c1, T s1, T c2, T s2,
                                                bool transpose, T* y1, T* y2) {
  if (transpose) {
    *y1 = rope_fma(x1, c1, rope_mul_rn(x2, s2));
    *y2 = rope_fma(x2, c2, -rope_mul_rn(x1, s1));
  } else {
    *y1 = rope_fma(x1, c1, -rope_mul_rn(x2, s1));
    *y2 = rope_fma(x2, c2, rope_mul_rn(x1, s2));
  }
}

POSENC_HOST_DEVICE double rope_default_inv_freq(int64_t i, int64_t rotary_dim, double base) {
  return 1.0 / pow(base, static_cast<double>(2 * i) / static_cast<double>(rotary_dim));
}

// yarn's attention scaling: 0.1 * mscale * ln(scale) + 1 for scale > 1.
POSENC_HOST_DEVICE double yarn_get_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

// yarn: the (fractional) pair index whose wavelength makes num_rotations turns over
// max_pos positions.
POSENC_HOST_DEVICE double yarn_correction_dim(double num_rotations, int64_t dim, double base,
                                              double max_pos) {
  const double two_pi = 6.283185307179586476925286766559;
  return (static_cast<double>(dim) * log(max_pos / (num_rotations * two_pi))) / (2.0 * log(base));
}

// A type's row of POSENC_ROPE_TYPES: its facts (kRope* flags) and the keys it reads (bit k:
// RopeKey(k), as RopeScalingParams::given).
struct RopeTypeRow {
  unsigned facts;
  uint32_t keys;
};
inline constexpr RopeTypeRow rope_type_row(RopeType t) {
  switch (t) {
#define POSENC_X(e, name, facts, keys) \
  case RopeType::e:                    \
    return RopeTypeRow{facts, keys};
    POSENC_ROPE_TYPES(POSENC_X)
#undef POSENC_X
  }
  return RopeTypeRow{0u, 0u};
}
inline constexpr unsigned rope_type_facts(RopeType t) { return rope_type_row(t).facts; }
inline constexpr uint32_t rope_type_keys(RopeType t) { return rope_type_row(t).keys; }

// The types whose frequencies depend on the call's length (longest position + 1).
inline constexpr bool rope_scales_by_length(RopeType t) {
  return (rope_type_facts(t) & kRopeScalesByLength) != 0;
}

// The frequency of pair i after scaling. seq_len matters for "dynamic" and "longrope": the longest
// position + 1 of the call (0 or anything up to original_max_position_embeddings gives the
// unscaled frequencies, as in transformers).
POSENC_HOST_DEVICE double rope_inv_freq(int64_t i, int64_t rotary_dim, double base,
                                        const RopeScalingParams& s, int64_t seq_len) {
  switch (s.type) {
    case RopeType::kLinear:
      return rope_default_inv_freq(i, rotary_dim, base) / s.factor;
    case RopeType::kDynamic: {
      const double orig = s.original_max_position_embeddings;
      const double len = static_cast<double>(seq_len) > orig ? static_cast<double>(seq_len) : orig;
      const double d = static_cast<double>(rotary_dim);
      const double scaled_base =
          base * pow(s.factor * len / orig - (s.factor - 1.0), d / (d - 2.0));
      return rope_default_inv_freq(i, rotary_dim, scaled_base);
    }
    case RopeType::kYarn: {
      const double beta_fast = !rope_has(s, RopeKey::beta_fast) ? 32.0 : s.beta_fast;
      const double beta_slow = !rope_has(s, RopeKey::beta_slow) ? 1.0 : s.beta_slow;
      const bool truncate = !rope_has(s, RopeKey::truncate) || s.truncate != 0.0;
      const double orig = s.original_max_position_embeddings;
      double low = yarn_correction_dim(beta_fast, rotary_dim, base, orig);
      double high = yarn_correction_dim(beta_slow, rotary_dim, base, orig);
      if (truncate) {
        low = floor(low);
        high = ceil(high);
      }
      low = low > 0.0 ? low : 0.0;
      high = high < static_cast<double>(rotary_dim - 1) ? high : static_cast<double>(rotary_dim - 1);
      if (low == high) high += 0.001;  // as transformers: no division by zero in the ramp
      double ramp = (static_cast<double>(i) - low) / (high - low);
      ramp = ramp < 0.0 ? 0.0 : (ramp > 1.0 ? 1.0 : ramp);
      const double extrapolation = rope_default_inv_freq(i, rotary_dim, base);
      const double interpolation = extrapolation / s.factor;
      // ramp 0: high frequency, kept (extrapolated); ramp 1: low frequency, interpolated.
      const double keep = 1.0 - ramp;
      return interpolation * (1.0 - keep) + extrapolation * keep;
    }
    case RopeType::kLlama3: {
      const double two_pi = 6.283185307179586476925286766559;
      const double inv = rope_default_inv_freq(i, rotary_dim, base);
      const double orig = s.original_max_position_embeddings;
      const double low_freq_wavelen = orig / s.low_freq_factor;
      const double high_freq_wavelen = orig / s.high_freq_factor;
      const double wavelen = two_pi / inv;
      if (wavelen < high_freq_wavelen) return inv;
      if (wavelen > low_freq_wavelen) return inv / s.factor;
      const double smooth =
          (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      return (1.0 - smooth) * inv / s.factor + smooth * inv;
    }
    case RopeType::kLongrope: {
      // transformers: 1 / (ext[i] * base^(2i/d)), ext the long factors once the call reaches
      // beyond original_max_position_embeddings, the short ones until then.
      const bool long_context = static_cast<double>(seq_len) > s.original_max_position_embeddings;
      const double ext = long_context ? s.long_factor[i] : s.short_factor[i];
      return rope_default_inv_freq(i, rotary_dim, base) / ext;
    }
    case RopeType::kProportional: {
      // Gemma 4 (transformers' _compute_proportional_rope_parameters): the first
      // int(partial_rotary_factor * head_dim // 2) pairs turn (partial_rotary_factor default
      // 1: all of them), the others keep angle 0 in place (rotary_dim is the whole head_dim
      // here); all divided by factor (default 1).
      const double share = !rope_has(s, RopeKey::partial_rotary_factor) ? 1.0 : s.partial_rotary_factor;
      const double angles = floor(share * static_cast<double>(rotary_dim) / 2.0);
      const double factor = !rope_has(s, RopeKey::factor) ? 1.0 : s.factor;
      return static_cast<double>(i) < angles ? rope_default_inv_freq(i, rotary_dim, base) / factor : 0.0;
    }
    case RopeType::kDefault:
    default:
      return rope_default_inv_freq(i, rotary_dim, base);
  }
}

// The factor cos and sin are multiplied by (yarn's and longrope's attention scaling; 1 for
// the others).
POSENC_HOST_DEVICE double rope_attention_factor(const RopeScalingParams& s) {
  if (s.type == RopeType::kLongrope) {
    // The given attention_factor, else sqrt(1 + ln(factor) / ln(original)) (the LongRoPE
    // paper's, as transformers computes it; 1 for factor <= 1).
    if (rope_has(s, RopeKey::attention_factor)) return s.attention_factor;
    if (s.factor <= 1.0) return 1.0;
    return sqrt(1.0 + log(s.factor) / log(s.original_max_position_embeddings));
  }
  if (s.type != RopeType::kYarn) return 1.0;
  if (rope_has(s, RopeKey::attention_factor)) return s.attention_factor;
  if (rope_has(s, RopeKey::mscale) && rope_has(s, RopeKey::mscale_all_dim) && s.mscale != 0.0 && s.mscale_all_dim != 0.0) {
    return yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim);
  }
  return yarn_get_mscale(s.factor, 1.0);
}

// sin and cos of r in [-pi/4, pi/4]: minimax polynomials (float32, < 1 ulp on that range),
// the same on host and device so that CPU and CUDA kernels agree. Each step is an explicit
// rounded product or fused multiply-add, as the rotation's are: written as plain a + b * c,
// the AVX2 build (-mfma) and nvcc contracted it into FMAs while the baseline build rounded
// every step, so the CPU levels differed by 1 ulp in ~2% of the angles. These are the FMAs
// gcc's and nvcc's contraction chose, so the AVX2 and CUDA bits are unchanged (checked on
// 20M angles); a CPU without FMA instructions computes them in software (slower, same bits).
POSENC_HOST_DEVICE void rope_sincos_reduced(float r, float* s, float* c) {
  const float r2 = rope_mul_rn(r, r);
  const float ps = rope_fma(r2, rope_fma(r2, -1.9515295891e-4f, 8.3321608736e-3f), -1.6666654611e-1f);
  *s = rope_fma(rope_mul_rn(r, r2), ps, r);
  const float pc = rope_fma(r2, rope_fma(r2, 2.443315711809948e-5f, -1.388731625493765e-3f),
                            4.166664568298827e-2f);
  *c = rope_fma(rope_mul_rn(r2, r2), pc, rope_fma(-0.5f, r2, 1.0f));
}

POSENC_HOST_DEVICE void rope_sincos_reduced(double r, double* s, double* c) {
  *s = sin(r);
  *c = cos(r);
}

// The largest inverse frequency the kernels take (rope_pair_frequencies refuses more).
// Positions reach 2^54 (an offset plus a position, each within 2^53), so angles stay within
// 2^70, which rope_sincos's two steps reduce into [-pi/4, pi/4] (the first leaves at most
// ~|angle| * 2^-52, far below the 2^42 the second takes exactly) with ~2^-36 radians of
// error at most; at 1e300 (a linear factor of 1e-300) they could not, and the float
// polynomials got inf: NaN outputs. No model comes near: 1 / factor of a linear factor 2^-16.
constexpr double kRopeMaxInvFreq = 0x1p16;

// The largest |r| rope_sincos hands the polynomials: pi/4 and a margin of 2^-10 (their
// error stays < 1 ulp there; the rounding of angle * 2/pi puts r past pi/4 by at most
// ~1e-4 for |angle| < 2^42, so those angles are reduced as they always were).
constexpr double kRopeReduceLimit = 0.78539816339744830962 + 0x1p-10;

// sin and cos of pos * inv_freq in precision T (float or double). The product and the
// reduction modulo pi/2 are done in double, so the error does not grow with pos. Written
// without branches (the quadrant picks values by selects) so that a loop over the pairs of
// a token vectorises on the CPU.
template <typename T>
POSENC_HOST_DEVICE void rope_sincos(int64_t pos, double inv_freq, T* s, T* c) {
  const double two_over_pi = 0.63661977236758134308;
  const double pio2_hi = 1.5707963267948965580e+00;  // pi/2 rounded to double
  const double pio2_lo = 6.1232339957367658e-17;     // pi/2 - pio2_hi
  const double angle = static_cast<double>(pos) * inv_freq;
  const double k0 = rint(angle * two_over_pi);
  const double r0 = fma(-k0, pio2_lo, fma(-k0, pio2_hi, angle));
  // Past |angle * 2/pi| ~ 2^42 the rounded product is no longer exact to a fraction of a
  // unit, so k0 can be off (one unit, two past 2^53) and r0 up to pi/2 or more, where the
  // float polynomials are wrong by up to ~2000 ulps: a second step, rint(r0 * 2/pi) units
  // back into [-pi/4, pi/4]. Below that an r0 is at most ~1e-4 past pi/4, inside
  // kRopeReduceLimit: unchanged (adjust 0 leaves r0 as it is).
  const double adjust = (r0 > kRopeReduceLimit || r0 < -kRopeReduceLimit) ? rint(r0 * two_over_pi) : 0.0;
  const double r = fma(-adjust, pio2_lo, fma(-adjust, pio2_hi, r0));
  T sr, cr;
  rope_sincos_reduced(static_cast<T>(r), &sr, &cr);
  // Quadrant q = (k0 + adjust) mod 4, from k0 mod 4 (exact in double): past 2^53 the sum
  // k0 + adjust is not representable (k0 is even there), its residue is. angle = r + q * pi/2:
  // q = 0: (sr, cr); 1: (cr, -sr); 2: (-sr, -cr); 3: (-cr, sr).
  // q_sum is a small integer (|adjust| grows with the angle: -5 near 2^56), exact, and its
  // residue mod 4 by floor is exact too (one +-4 correction took [-2, 5] only: a quarter
  // turn off past ~2^55.8; a fuzzing audit).
  const double q_sum = (k0 - 4.0 * floor(k0 * 0.25)) + adjust;
  const double q = q_sum - 4.0 * floor(q_sum * 0.25);
  const bool swap = q == 1.0 || q == 3.0;
  const T ss = swap ? cr : sr;
  const T cc = swap ? sr : cr;
  *s = q >= 2.0 ? -ss : ss;
  *c = (q == 1.0 || q == 2.0) ? -cc : cc;
}

POSENC_ISA_NAMESPACE_END

// ---- Multi-axis RoPE: each token has n_axes integer coordinates (e.g. (t, h, w)), and the
// rotary pairs are split into sections, one per axis (sections[a] pairs, summing to
// rotary_dim / 2). Pair p turns by pos[axis(p)] * inv_freq(p). Three ways to assign them,
// X(enumerator, "name"):
//   axial              contiguous sections, each its own 1-D RoPE of width 2 * sections[a]
//                      (FLUX's axes_dim / 2, EVA-02 / timm, torchtune vision);
//   mrope              contiguous sections over one frequency list base^(-2p/rotary_dim)
//                      (Qwen2-VL / Qwen2.5-VL mrope_section);
//   mrope_interleaved  the same frequencies, axes interleaved as in Qwen3-VL: pair p with
//                      p % n_axes == a >= 1 and p < n_axes * sections[a] reads axis a,
//                      every other pair axis 0.
#define POSENC_ROPE_SECTIONS_MODES(X) \
  X(kAxial, "axial")                  \
  X(kMrope, "mrope")                  \
  X(kMropeInterleaved, "mrope_interleaved")

enum class RopeSectionsMode : int {
#define POSENC_X(e, name) e,
  POSENC_ROPE_SECTIONS_MODES(POSENC_X)
#undef POSENC_X
};

// Most axes a call may have (the kernels keep one position per axis in registers).
constexpr int kRopeMaxAxes = 4;

POSENC_ISA_NAMESPACE_BEGIN

// The axis of pair p (sections checked: positive, summing to half = rotary_dim / 2, and for
// mrope_interleaved axis a >= 1's last pair, a + n_axes * (sections[a] - 1), below half).
POSENC_HOST_DEVICE int rope_pair_axis(int64_t p, const int64_t* sections, int n_axes,
                                      RopeSectionsMode mode) {
  if (mode == RopeSectionsMode::kMropeInterleaved) {
    const int a = static_cast<int>(p % n_axes);
    return (a >= 1 && p < n_axes * sections[a]) ? a : 0;
  }
  int64_t end = 0;
  for (int a = 0; a < n_axes; ++a) {
    end += sections[a];
    if (p < end) return a;
  }
  return n_axes - 1;
}

// The rotary width and pair index that pair p's frequency is computed with: (rotary_dim,
// p) for the mrope modes, (2 * sections[a], p - start of section a) for axial.
POSENC_HOST_DEVICE void rope_pair_frequency_index(int64_t p, int64_t rotary_dim,
                                                  const int64_t* sections, int n_axes,
                                                  RopeSectionsMode mode, int64_t* width,
                                                  int64_t* index) {
  *width = rotary_dim;
  *index = p;
  if (mode != RopeSectionsMode::kAxial) return;
  int64_t start = 0;
  for (int a = 0; a < n_axes; ++a) {
    if (p < start + sections[a]) {
      *width = 2 * sections[a];
      *index = p - start;
      return;
    }
    start += sections[a];
  }
}

// Packed variable-length batches ("thd"): the sequence that token t belongs to, given the
// cumulative lengths cu[0..n] (cu[0] = 0, increasing). Returns -1 when t is not covered,
// so that a kernel can mark the token instead of reading out of bounds.
template <typename index_t>  // int64_t, or int32_t (flash-attention's cu_seqlens, CUDA)
POSENC_HOST_DEVICE int64_t rope_sequence_of(const index_t* cu, int64_t n, int64_t t) {
  if (n <= 0 || t < cu[0] || t >= cu[n]) return -1;
  int64_t lo = 0, hi = n;  // invariant: cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (cu[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

POSENC_ISA_NAMESPACE_END

}  // namespace math
}  // namespace posenc
