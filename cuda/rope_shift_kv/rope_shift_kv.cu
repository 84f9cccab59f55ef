// CUDA kernel of rope_shift_kv_: one block per item (batch row, row turned; grid-stride). The
// block evaluates the item's turn once into shared memory (both ends' math::rope_sincos from
// float64 angles, combined by rope_shift_angle: the CPU kernel's steps), then its threads
// share the item's pairs over every head, each rotated in place in its cache row (FP8 rows:
// dequantised, rotated in float32, quantised back with the same scale). Element accesses with
// any strides; one read and one write of each pair turned; no host synchronisation.
//
// A row or slot out of range (which the CPU op refuses with an IndexError before writing) is
// skipped and stops the kernel with a device-side assert, as ATen's indexing does. A row
// listed twice (refused on the CPU) is the caller's error here: it would turn twice or race.
#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "../common/occupancy.cuh"
#include "../common/rope_device_checks.cuh"  // rope_in_position_domain
#include "launch.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace {

constexpr int kThreads = 128;

using rope_cuda::rope_in_position_domain;

// scalar_t: the cache's dtype, or float for an FP8 cache (its values are rotated in float32).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) rope_shift_kv_kernel(const __grid_constant__ RopeShiftKvArgs a) {
  using acc_t = cuda::opmath_t<scalar_t>;
  const RopeArgs& g = a.to;
  const int64_t items = g.batch * g.seq;
  const int64_t half = g.rotary_dim / 2;
  const int64_t begin = math::rope_rotary_begin(g.settings);
  const acc_t factor = static_cast<acc_t>(a.factor);
  // FP8 caches are rotated in float32 (scalar_t float): the other instantiations leave the
  // FP8 code out (it cost the 16-bit ones a spill).
  const bool fp8 = std::is_same_v<scalar_t, float> && a.format != KvCacheFormat::kSame;
  const float scale = a.scale_ptr != nullptr ? *a.scale_ptr : a.scale;
  __shared__ acc_t s_cos[kMaxRopePairs];
  __shared__ acc_t s_sin[kMaxRopePairs];
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    CUDA_KERNEL_ASSERT_MSG(!fp8 || (scale > 0.0f && static_cast<double>(scale) * kv_format_max(a.format) <= FLT_MAX),
                           "posenc: rope_shift_kv: expected k_scale to be a finite positive number, "
                           "at most float32's largest value / the format's largest");
  }
  auto* cache = static_cast<scalar_t*>(a.cache);
  auto* cache8 = static_cast<uint8_t*>(a.cache);
  const int64_t* st = a.cache_stride;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t b = item / g.seq;
    const int64_t j = item - b * g.seq;
    int64_t outer = 0, inner = 0;
    const bool turned = shift_kv_row(a, b, j, &outer, &inner);
    if (threadIdx.x == 0) {
      CUDA_KERNEL_ASSERT_MSG(turned || (a.slot_mapping != nullptr && a.slot_mapping[j] == -1),
                             "posenc: rope_shift_kv: a rows or slot_mapping value out of range "
                             "(it was not turned)");
    }
    if (!turned) continue;  // the same for every thread of the block
    bool keeps = true;
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const int64_t p_old = rope_axis_position(a.from, b, j, 0, 0, a.from.pair_axis[i]);
      const int64_t p_new = rope_axis_position(a.to, b, j, 0, 0, a.to.pair_axis[i]);
      CUDA_KERNEL_ASSERT_MSG(rope_in_position_domain(p_old) && rope_in_position_domain(p_new),
                             "posenc: rope_shift_kv: expected from_positions and to_positions "
                             "within " POSENC_ROPE_POSITION_RANGE);
      acc_t so, co, sn, cn;
      math::rope_sincos<acc_t>(p_old, a.from.inv_freq[i], &so, &co);
      math::rope_sincos<acc_t>(p_new, a.to.inv_freq[i], &sn, &cn);
      rope_shift_angle<acc_t>(cn, sn, co, so, factor, &s_cos[i], &s_sin[i]);
      keeps = keeps && rope_shift_keeps<acc_t>(p_old, p_new, cn, sn, co, so, factor);
    }
    // Every pair keeps its angle: the row stays as it is (the CPU kernel's rule); the block
    // leaves together, nothing read from the shared turn.
    if (__syncthreads_and(keeps)) continue;
    const int64_t pairs = a.heads * half;
    for (int64_t t = threadIdx.x; t < pairs; t += blockDim.x) {
      const int64_t h = t / half;
      const int64_t p = t - h * half;
      int64_t e1, e2;
      math::rope_pair_features(p, half, g.interleaved, &e1, &e2);
      const int64_t at = outer * st[0] + inner * st[1] + h * st[2];
      const int64_t o1 = at + (begin + e1) * st[3], o2 = at + (begin + e2) * st[3];
      acc_t x1, x2;
      if (fp8) {
        x1 = kv_dequantize(a.format, cache8[o1], scale);
        x2 = kv_dequantize(a.format, cache8[o2], scale);
      } else {
        x1 = static_cast<acc_t>(cache[o1]);
        x2 = static_cast<acc_t>(cache[o2]);
      }
      acc_t y1, y2;
      math::rope_rotate_pair(x1, x2, s_cos[p], s_sin[p], &y1, &y2);
      if (fp8) {
        cache8[o1] = kv_quantize(a.format, static_cast<float>(y1), scale);
        cache8[o2] = kv_quantize(a.format, static_cast<float>(y2), scale);
      } else {
        cache[o1] = static_cast<scalar_t>(y1);
        cache[o2] = static_cast<scalar_t>(y2);
      }
    }
    __syncthreads();  // the next item's turn overwrites this one's
  }
}

}  // namespace

template <typename scalar_t>
cudaError_t launch_rope_shift_kv(const RopeShiftKvArgs& a, cudaStream_t stream) {
  const int64_t items = a.to.batch * a.to.seq;
  if (items == 0 || a.heads == 0 || a.to.rotary_dim == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>(items, 65535);
  rope_shift_kv_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_rope_shift_kv, const RopeShiftKvArgs&, cudaStream_t)

}  // namespace ops
}  // namespace posenc
