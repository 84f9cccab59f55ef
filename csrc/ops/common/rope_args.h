// What a RoPE kernel needs, as plain data: pointers, sizes and strides of q and k seen as
// (batch, seq, heads, head_dim) whatever the user's layout, the position source, and the
// frequencies of the call, one per rotary pair with the position axis it reads. The same
// struct is passed by value to the CUDA kernel (2608 bytes; rope_shift_kv passes two, 5.2
// KiB, which needs CUDA >= 12.1's 32 KiB kernel-parameter space: posenc builds against
// torch 2.11's CUDA 13), so CPU and CUDA read identical inputs.
#pragma once

#include <cstdint>

#include "posenc/math/host_device.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {

// Pairs per head the kernels support: rotary_dim <= 512 (rope_checks.h checks it).
constexpr int64_t kMaxRopePairs = math::kRopeMaxPairs;

// Positions, offsets and the int offset each lie in [-2**53, 2**53] (check_rope_position_value
// on the host, rope_in_position_domain on the device): sums of three of them cannot overflow
// int64, and a summed position within +-2**53 is exact in the float64 angle (beyond, up to
// 3 * 2**53, the float64 product rounds it).
constexpr int64_t kRopeMaxPosition = int64_t{1} << 53;
// That range as every message names it (host checks and the CUDA kernels' device asserts,
// which take a string literal).
#define POSENC_ROPE_POSITION_RANGE "[-2**53, 2**53]"

// One of q and k: input and output (the same pointer in place) as (B, S, H, D) with
// element strides.
struct RopeOperand {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t heads = 0;  // 0: operand absent
  int64_t in_stride[4] = {0, 0, 0, 0};
  int64_t out_stride[4] = {0, 0, 0, 0};
};

struct RopeArgs {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // even, <= head_dim; features beyond it pass through
  bool interleaved = false;
  bool inverse = false;  // rotate by -angle (the backward)
  math::RopeSettings settings;  // the call's plain settings (where the rotary part starts)
  RopeOperand q, k;
  // Positions: coordinate `axis` of token (b, s) is
  //   positions[axis * positions_axis_stride + b * positions_batch_stride + s]
  // (batch stride 0 for positions shared by the batch rows), or s itself when null; plus
  // offset and offsets[b] (per-sequence offsets) when given, on every axis.
  const int64_t* positions = nullptr;
  int64_t positions_batch_stride = 0;
  int64_t positions_axis_stride = 0;
  int64_t n_axes = 1;
  const int64_t* offsets = nullptr;
  int64_t offset = 0;
  // Packed sequences ("thd", batch = 1): cu_seqlens[0..num_seqs]; offsets[] is indexed by
  // sequence, and without positions the position of token t restarts at each sequence.
  // cu_seqlens32 instead when an int32 cu_seqlens is read as it is (CUDA: no conversion
  // launch per call); at most one of the two is set.
  const int64_t* cu_seqlens = nullptr;
  const int32_t* cu_seqlens32 = nullptr;
  int64_t num_seqs = 0;
  double attention_factor = 1.0;  // multiplies cos and sin (yarn)
  double inv_freq[kMaxRopePairs];
  uint8_t pair_axis[kMaxRopePairs];  // the position axis pair p turns with
};

POSENC_ISA_NAMESPACE_BEGIN

// Where token (b, s) starts: its shift (offset + its row's or sequence's offset) and, for
// packed sequences without positions, the index its sequence restarts at. False when a
// packed token lies outside every sequence: the CPU op refuses such cu_seqlens before its
// kernel, the CUDA kernel stops with a device-side assert (cuda/common/rope_device_checks.cuh).
POSENC_HOST_DEVICE bool rope_token_shift(const RopeArgs& a, int64_t b, int64_t s, int64_t* shift,
                                         int64_t* restart) {
  *restart = 0;
  if (a.cu_seqlens != nullptr || a.cu_seqlens32 != nullptr) {
    const int64_t j = a.cu_seqlens != nullptr
                          ? math::rope_sequence_of(a.cu_seqlens, a.num_seqs, s)
                          : math::rope_sequence_of(a.cu_seqlens32, a.num_seqs, s);
    if (j < 0) return false;
    *restart = a.cu_seqlens != nullptr ? a.cu_seqlens[j] : a.cu_seqlens32[j];
    *shift = a.offset + (a.offsets != nullptr ? a.offsets[j] : 0);
    return true;
  }
  *shift = a.offset + (a.offsets != nullptr ? a.offsets[b] : 0);
  return true;
}

// Coordinate `axis` of token (b, s), given its shift and restart.
POSENC_HOST_DEVICE int64_t rope_axis_position(const RopeArgs& a, int64_t b, int64_t s,
                                              int64_t shift, int64_t restart, int64_t axis) {
  const int64_t base =
      a.positions != nullptr
          ? a.positions[axis * a.positions_axis_stride + b * a.positions_batch_stride + s]
          : s - restart;
  return base + shift;
}

POSENC_ISA_NAMESPACE_END

}  // namespace ops
}  // namespace posenc
