// The plain-data interface of rope_shift_kv's kernels (RopeShiftKvArgs: the cache, which rows
// turn, the two RoPE configurations they turn between; the CUDA kernel takes it by value),
// the per-pair math both kernels share (host and device), and the CPU kernel's entry point,
// compiled in the vector-ISA translation unit cpu/kernel.cpp once per capability; callers go
// through rope_shift_kv_stub.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>

#include "ops/common/cpu/cpu_capability.h"
#include "ops/common/rope_args.h"
#include "ops/rope_append_kv/cpu/kernel.h"  // KvCacheFormat, kv_quantize: the FP8 caches' rule
#include "posenc/math/host_device.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {

struct RopeShiftKvArgs {
  // The two ends of the rotation, as RoPE calls over (batch, n) items (paged: batch 1): their
  // positions (from_positions / to_positions, read as RoPE reads positions: per axis, per
  // batch row or shared), frequencies and settings. attention_factor is 1 in both; the
  // ratio of the configurations' factors is `factor` below. `to` also gives the row geometry
  // (head_dim, rotary_dim, interleaved, rotary_offset).
  RopeArgs from, to;
  double factor = 1.0;  // attention factor of `to` / that of `from` (1: the cache has it)
  int64_t heads = 0;
  // The cache as (batch or block, row or index in the block, kv_heads, head_dim), element
  // strides ("bhsd" is transposed into this view).
  void* cache = nullptr;
  int64_t cache_stride[4] = {0, 0, 0, 0};
  // Contiguous cache: item (b, j) is cache row rows[b * rows_batch_stride + j] of batch row
  // b (rows null: row j), rows < max_len. Paged cache (slot_mapping set): item j is slot
  // slot_mapping[j] = block * block_size + index, slots < num_slots; -1: not rotated.
  const int64_t* rows = nullptr;
  int64_t rows_batch_stride = 0;
  int64_t max_len = 0;
  const int64_t* slot_mapping = nullptr;
  int64_t block_size = 0;
  int64_t num_slots = 0;
  // FP8 caches: each value is dequantised (bits to float32, times the scale), rotated in
  // float32 and quantised back with the same scale (kv_quantize). The scale is `scale`, or,
  // when its tensor lives on the kernel's device, read from scale_ptr by the kernel.
  KvCacheFormat format = KvCacheFormat::kSame;
  float scale = 1.0f;
  const float* scale_ptr = nullptr;
};

POSENC_ISA_NAMESPACE_BEGIN

// Where item (b, j) lives: (cache row or block, index) into *outer, *inner. False when it is
// not rotated: slot -1, or out of range (the CPU op refuses those before its kernel; the CUDA
// kernel asserts and skips them).
POSENC_HOST_DEVICE bool shift_kv_row(const RopeShiftKvArgs& a, int64_t b, int64_t j, int64_t* outer,
                                     int64_t* inner) {
  if (a.slot_mapping != nullptr) return kv_cache_slot(a.slot_mapping[j], a.num_slots, a.block_size, outer, inner);
  const int64_t row = a.rows != nullptr ? a.rows[b * a.rows_batch_stride + j] : j;
  if (row < 0 || row >= a.max_len) return false;
  *outer = b;
  *inner = row;
  return true;
}

// The rotation from angle `old` to angle `new` of one pair, given the cos and sin of each
// (math::rope_sincos, from float64 angles, as every kernel computes them): the angle
// new - old as (cos, sin) = (cn co + sn so, sn co - cn so), each one rounded product and one
// fused multiply-add in T (float32; float64 for float64 caches), times `factor` (the ratio of
// the attention factors; exact when 1). The same steps on every path, CPU and CUDA.
template <typename T>
POSENC_HOST_DEVICE void rope_shift_angle(T cn, T sn, T co, T so, T factor, T* c, T* s) {
  *c = math::rope_fma(cn, co, math::rope_mul_rn(sn, so)) * factor;
  *s = math::rope_fma(sn, co, -math::rope_mul_rn(cn, so)) * factor;
}

// Whether a pair keeps its angle: the same position and the same cos and sin at both ends
// (and no change of attention factor). A row all of whose pairs keep theirs (a row shifted to
// its own position: the sinks of an attention-sinks loop) is neither read nor written, on
// every path: rope_shift_angle's turn rounds to 1 - 1 ulp there, and repeated shifts in
// place would drift by an ulp a call; skipped, the row keeps its bits (signed zeros and FP8
// codes included).
template <typename T>
POSENC_HOST_DEVICE bool rope_shift_keeps(int64_t p_old, int64_t p_new, T cn, T sn, T co, T so, T factor) {
  return p_old == p_new && cn == co && sn == so && factor == T(1);
}

// The float32 value of an FP8 cache's bits: c10's conversion (exact), times the scale.
POSENC_HOST_DEVICE float kv_dequantize(KvCacheFormat f, uint8_t bits, float scale) {
  const float x = f == KvCacheFormat::kFloat8E4M3 ? c10::detail::fp8e4m3fn_to_fp32_value(bits)
                                                  : c10::detail::fp8e5m2_to_fp32_value(bits);
  return math::rope_mul_rn(x, scale);
}

POSENC_ISA_NAMESPACE_END

namespace cpu {

// Rotates every listed row of the cache in place (all heads); every row is in range and
// listed once (checked before).
using RopeShiftKvFn = void (*)(const RopeShiftKvArgs& a, c10::ScalarType dtype);
POSENC_DECLARE_DISPATCH(RopeShiftKvFn, rope_shift_kv_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
