// Counter-based random bits for the fused dropout, shared by the CPU and CUDA kernels
// so that both draw the same mask from the same (seed, offset).
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011)
// maps a 128-bit counter and a 64-bit key to 128 random bits. We give every element
// 16 bits, so one call serves a block of 8 consecutive elements:
//   key     = seed (64 bit)
//   counter = (generator offset / 4: 64 bit, block index: 64 bit), block = element / 8
// This is the counter layout of curand_init(seed, subsequence = block, offset), which
// PyTorch's CUDA random kernels use: our block b gets exactly the first four words a torch
// kernel thread b would draw at the offset the generator reserved for this call. Since the
// generator hands every call its own offset range, posenc's masks can coincide neither with
// each other nor with another op's random numbers (an earlier layout, (block, offset),
// could: block b of a call at offset O equalled thread O's draw n = b of a torch kernel).
// Element e keeps its value iff bits16(e) >= round(p * 65536): p is resolved to
// multiples of 2^-16 (p = 1 drops everything, p = 0 nothing).
#pragma once

#include <cstdint>

#include "posenc/math/host_device.h"

namespace posenc {
namespace math {

constexpr int kDropoutBlock = 8;  // elements served by one Philox call

struct Philox4x32 {
  uint32_t v[4];
};

POSENC_ISA_NAMESPACE_BEGIN

POSENC_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi,
                                       uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// One Philox4x32 round on counter (c0..c3) with round key (k0, k1). Kept separate so
// the CPU kernel can run the rounds over several counters at once (SIMD lanes).
POSENC_HOST_DEVICE void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3,
                                     uint32_t k0, uint32_t k1) {
  uint32_t hi0, lo0, hi1, lo1;
  philox_mulhilo(kPhiloxMul0, c0, hi0, lo0);
  philox_mulhilo(kPhiloxMul1, c2, hi1, lo1);
  c0 = hi1 ^ c1 ^ k0;
  c1 = lo1;
  c2 = hi0 ^ c3 ^ k1;
  c3 = lo0;
}

// Ten rounds of Philox4x32 on counter (c0..c3) with key (k0, k1).
POSENC_HOST_DEVICE Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2,
                                            uint32_t c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < kPhiloxRounds; ++round) {
    philox_round(c0, c1, c2, c3, k0, k1);
    k0 += kPhiloxWeyl0;
    k1 += kPhiloxWeyl1;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// The counter of dropout block `block` in a call with generator offset `offset` (a multiple
// of 4 on CUDA, where the call reserves 4 offsets: one 128-bit draw per block; the CPU
// draws a fresh seed and uses offset 0). Offsets that differ only in their two low bits
// share counters, as in curand; a hand-made rng pair should keep offset % 4 == 0.
POSENC_HOST_DEVICE void dropout_counter(uint64_t offset, uint64_t block, uint32_t& c0,
                                        uint32_t& c1, uint32_t& c2, uint32_t& c3) {
  c0 = static_cast<uint32_t>(offset >> 2);
  c1 = static_cast<uint32_t>(offset >> 34);
  c2 = static_cast<uint32_t>(block);
  c3 = static_cast<uint32_t>(block >> 32);
}

// The 128 random bits for dropout block `block` of a call with (seed, offset).
POSENC_HOST_DEVICE Philox4x32 dropout_block_bits(uint64_t seed, uint64_t offset,
                                                 uint64_t block) {
  uint32_t c0, c1, c2, c3;
  dropout_counter(offset, block, c0, c1, c2, c3);
  return philox4x32_10(c0, c1, c2, c3, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// The 16 random bits of lane (0..7) within its block.
POSENC_HOST_DEVICE uint32_t dropout_lane_bits(const Philox4x32& bits, int lane) {
  return (bits.v[lane >> 1] >> ((lane & 1) * 16)) & 0xFFFFu;
}

POSENC_ISA_NAMESPACE_END

// The keep/drop parameters of one call, computed once on the host.
struct DropoutParams {
  uint32_t threshold;  // drop iff bits16 < threshold; 0 disables dropout
  double keep_prob;    // 1 - p (0 when p >= 1): survivors are scaled by dropout_scale of it
};

POSENC_ISA_NAMESPACE_BEGIN

// The factor of the survivors in acc_t, as ATen's dropout computes it (nn.Dropout on CPU:
// noise.div_(1 - p), 1 - p rounded to the tensor's dtype and one division in it): float32
// 1.0f / float(1 - p), float64 1 / (1 - p); 0 when nothing is kept. (1 / (1 - p) in float64
// rounded to float32 differs from it for about a quarter of p values, p = 0.15 among them: an audit.)
template <typename acc_t>
POSENC_HOST_DEVICE acc_t dropout_scale(double keep_prob) {
  const acc_t keep = static_cast<acc_t>(keep_prob);
  return keep > acc_t(0) ? acc_t(1) / keep : acc_t(0);
}

inline DropoutParams make_dropout_params(double p) {
  DropoutParams params;
  const double scaled = p * 65536.0 + 0.5;
  params.threshold = scaled >= 65536.0 ? 65536u : static_cast<uint32_t>(scaled);
  params.keep_prob = p >= 1.0 ? 0.0 : 1.0 - p;
  return params;
}

POSENC_ISA_NAMESPACE_END

}  // namespace math
}  // namespace posenc
