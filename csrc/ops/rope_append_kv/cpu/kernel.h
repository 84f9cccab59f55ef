// The plain-data interface of rope_append_kv's kernels: what a kernel needs besides the
// rotation (KvCacheArgs: v, the two caches and where each new token's row goes; the CUDA
// kernel takes it by value), and the CPU kernel's entry point, compiled in the vector-ISA
// translation unit cpu/kernel.cpp once per capability; callers go through rope_append_kv_stub.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>

#include "ops/common/cpu/cpu_capability.h"
#include "ops/common/rope_args.h"
#include "ops/qk_norm_rope/cpu/kernel.h"  // QkNorm
#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {

// What a cache holds: the new rows as they are (the cache has k's, or v's, dtype), or FP8
// values quantised from them (kv_quantize).
enum class KvCacheFormat : uint8_t { kSame = 0, kFloat8E4M3 = 1, kFloat8E5M2 = 2 };

struct KvCacheArgs {
  // The rotation of q and k, tokens as (batch, seq) ('thd': batch 1, seq = tokens); q.out
  // is the rotated q, k.out the returned k (written only when write_k).
  RopeArgs rope;
  bool write_k = false;
  // v as (batch, seq, kv_heads, v_head_dim), element strides.
  const void* v = nullptr;
  int64_t v_head_dim = 0;
  int64_t v_stride[4] = {0, 0, 0, 0};
  // The caches as (batch or block, row or index in the block, kv_heads, head_dim), element
  // strides ("bhsd" is transposed into this view; the heads of k and v are the same).
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t k_cache_stride[4] = {0, 0, 0, 0};
  int64_t v_cache_stride[4] = {0, 0, 0, 0};
  // Contiguous cache: token (b, s) goes to row offset + offsets[b] + s of cache row b, rows
  // < max_len. Paged cache (slot_mapping set): token s goes to slot slot_mapping[s] = block
  // * block_size + index, slots < num_slots; -1: not written.
  int64_t offset = 0;
  const int64_t* offsets = nullptr;
  int64_t max_len = 0;
  const int64_t* slot_mapping = nullptr;
  int64_t block_size = 0;
  int64_t num_slots = 0;
  // FP8 caches: each value written is quantised with its cache's scale (kv_quantize). The
  // scale is k_scale / v_scale, or, when the scale tensor lives on the kernel's device (CUDA:
  // a CUDA graph can hold it), read from *_scale_ptr by the kernel.
  KvCacheFormat k_format = KvCacheFormat::kSame;
  KvCacheFormat v_format = KvCacheFormat::kSame;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  const float* k_scale_ptr = nullptr;
  const float* v_scale_ptr = nullptr;
  // QK-norm (set: q_weight != nullptr): q and k are normalised before they are rotated, as
  // qk_norm_rope's forward does (QkNormRopeArgs: RMSNorm of each head's row, or of the
  // token's whole projection, norm kHidden, with eps), weighted by the effective weights
  // (weight + weight_offset in the compute type, contiguous: head_dim or heads * head_dim
  // values). The cache and the returned k hold qk_norm_rope's k; an FP8 cache what
  // qk_norm_rope gives a float32 copy of k, quantised.
  const void* q_weight = nullptr;
  const void* k_weight = nullptr;
  double eps = 1e-6;
  QkNorm norm = QkNorm::kHead;
};

POSENC_ISA_NAMESPACE_BEGIN

// Where token (b, s) goes: (cache row or block, index) into *outer, *inner. False when it is
// not written: slot -1, or out of range (the CPU op refuses those before its kernel; the CUDA
// kernel asserts and skips them).
// A paged cache's slot (block * block_size + index) as (block, index); false for -1 (not
// written) or out of range. rope_append_kv's and rope_shift_kv's rule.
POSENC_HOST_DEVICE bool kv_cache_slot(int64_t slot, int64_t num_slots, int64_t block_size, int64_t* outer,
                                      int64_t* inner) {
  if (slot < 0 || slot >= num_slots) return false;
  *outer = slot / block_size;
  *inner = slot - *outer * block_size;
  return true;
}

POSENC_HOST_DEVICE bool kv_cache_row(const KvCacheArgs& a, int64_t b, int64_t s, int64_t* outer,
                                     int64_t* inner) {
  if (a.slot_mapping != nullptr) return kv_cache_slot(a.slot_mapping[s], a.num_slots, a.block_size, outer, inner);
  // A per-sequence offset outside [-2**53, 2**53] is no row (the CPU op refuses it first; on
  // CUDA the kernel asserts): one just outside could sum into the cache's rows, one near
  // +-2**63 would overflow (undefined). (a.offset is checked on the host; s < 2**62.)
  const int64_t o = a.offsets != nullptr ? a.offsets[b] : 0;
  if (o < -kRopeMaxPosition || o > kRopeMaxPosition) return false;
  const int64_t row = a.offset + o + s;
  if (row < 0 || row >= a.max_len) return false;
  *outer = b;
  *inner = row;
  return true;
}

// The FP8 value of x in a cache of format f (not kSame) with scale `scale`, as its bits: x / scale
// in float32 (a true division, as torch's x / scale), saturated to the format's largest finite
// value (448 for e4m3fn, 57344 for e5m2: a finite x never becomes NaN or inf, as vLLM's and
// FlashInfer's SATFINITE conversions; NaN stays NaN), then rounded to nearest even by c10's
// conversion (torch's .to(float8)). So a cache holds bit for bit
// (x / scale).clamp(-max, max).to(float8) of the float32 value the cache would hold.
POSENC_HOST_DEVICE float kv_format_max(KvCacheFormat f) {  // the format's largest finite value
  return f == KvCacheFormat::kFloat8E4M3 ? 448.0f : 57344.0f;
}

POSENC_HOST_DEVICE uint8_t kv_quantize(KvCacheFormat f, float x, float scale) {
  const float m = kv_format_max(f);
  float y = x / scale;
  if (y > m) {
    y = m;
  } else if (y < -m) {
    y = -m;
  }  // NaN fails both comparisons and stays NaN
  return f == KvCacheFormat::kFloat8E4M3 ? c10::detail::fp8e4m3fn_from_fp32_value(y)
                                         : c10::detail::fp8e5m2_from_fp32_value(y);
}

POSENC_ISA_NAMESPACE_END

namespace cpu {

// Rotates q (and k) of `a` and writes the rotated k and v into the caches, all tokens; every
// row is in range (checked before).
using RopeAppendKvFn = void (*)(const KvCacheArgs& a, c10::ScalarType dtype);
POSENC_DECLARE_DISPATCH(RopeAppendKvFn, rope_append_kv_stub)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
