// CUDA kernel of rope_append_kv / rope_append_kv_: one block per token (grid-stride). The
// block evaluates the token's cos/sin once into shared memory (math::rope_sincos, float64
// angle reduction, as RoPE's kernels), then its threads share the token's elements: the
// pairs of q's heads (rotated into q's output), of k's heads (rotated into the token's cache
// row, and into the returned k when asked), the pass-through features beyond rotary_dim, and
// v's elements (copied into the cache row). Element accesses with any strides; one read of
// q, k, v and one write of q and of each cache row; no host synchronisation.
//
// The rows are never written outside the cache: a row or slot out of range (which the CPU op
// refuses with an IndexError before writing) is skipped and stops the kernel with a
// device-side assert, as ATen's indexing does (a RuntimeError at the next synchronisation).
//
// QK-norm (q_weight set: a second instantiation, kNorm, so the plain path's code is the same):
// q and k are RMS-normalised before they are rotated, as qk_norm_rope's CUDA forward does and
// with its reduction order. The block's warps take the token's normalised vectors in turn (a
// head of q or k, norm "head"; q's and k's whole projection, norm "hidden"): lane l sums the
// squares of features l, l + 32, ... (heads in order), a fixed butterfly of shuffles adds the
// lanes (deterministic, no shared memory: any number of heads), then each lane normalises,
// weights and rotates its pairs and pass-through features (posenc/math/qk_norm.h) into the
// same destinations as the plain path. In place, each lane writes only features it read
// itself, after the whole warp's reads (the butterfly). v is copied first, as before.
#include <algorithm>
#include <cfloat>

#include "../common/occupancy.cuh"
#include "../common/rope_device_checks.cuh"  // rope_in_position_domain
#include "../common/warp_reduce.cuh"
#include "launch.h"
#include "posenc/math/qk_norm.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

using rope_cuda::rope_in_position_domain;
using rope_cuda::warp_sum;

// Where one head's rotated row goes: q's output; or k's cache row (dst8 instead of dst[0]
// for an FP8 cache: the float32 value quantised with k_scale) and the returned k.
template <typename scalar_t>
struct RowDestinations {
  scalar_t* dst[2] = {nullptr, nullptr};
  int64_t dsd[2] = {0, 0};
  uint8_t* dst8 = nullptr;

  template <typename T>
  __device__ __forceinline__ void store(int64_t f, T y, KvCacheFormat k_format, float k_scale) const {
    for (int d = 0; d < 2; ++d) {
      if (dst[d] != nullptr) dst[d][f * dsd[d]] = static_cast<scalar_t>(y);
    }
    if (dst8 != nullptr) dst8[f * dsd[0]] = kv_quantize(k_format, static_cast<float>(y), k_scale);
  }
};

template <typename scalar_t>
__device__ __forceinline__ RowDestinations<scalar_t> row_destinations(const KvCacheArgs& a, bool is_q, int64_t b,
                                                                      int64_t s, int64_t h, bool cached,
                                                                      int64_t outer, int64_t inner) {
  const RopeOperand& op = is_q ? a.rope.q : a.rope.k;
  RowDestinations<scalar_t> r;
  auto* out = static_cast<scalar_t*>(op.out) + b * op.out_stride[0] + s * op.out_stride[1] + h * op.out_stride[2];
  if (is_q) {
    r.dst[0] = out;
    r.dsd[0] = op.out_stride[3];
    return r;
  }
  if (cached) {
    const int64_t at = outer * a.k_cache_stride[0] + inner * a.k_cache_stride[1] + h * a.k_cache_stride[2];
    if (a.k_format != KvCacheFormat::kSame) {
      r.dst8 = static_cast<uint8_t*>(a.k_cache) + at;
    } else {
      r.dst[0] = static_cast<scalar_t*>(a.k_cache) + at;
    }
    r.dsd[0] = a.k_cache_stride[3];
  }
  if (a.write_k) {
    r.dst[1] = out;
    r.dsd[1] = op.out_stride[3];
  }
  return r;
}

// QK-norm: token (b, s)'s q and k normalised, weighted and rotated (cos/sin in cs, sn) by the
// block's warps, one normalised vector per warp at a time; k into its cache row (FP8: the
// float32 value quantised) when cached, and into the returned k when write_k.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void norm_rotate_token(const KvCacheArgs& a, int64_t b, int64_t s,
                                                  bool cached, int64_t outer, int64_t inner,
                                                  float k_scale, const acc_t* cs, const acc_t* sn) {
  const RopeArgs& r = a.rope;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t D = r.head_dim, half = r.rotary_dim / 2, pass = D - r.rotary_dim;
  const int64_t begin = math::rope_rotary_begin(r.settings);
  const bool hidden = a.norm == QkNorm::kHidden;
  const acc_t eps = static_cast<acc_t>(a.eps);
  const int64_t q_groups = hidden ? 1 : r.q.heads;
  const int64_t groups = q_groups + (hidden ? 1 : r.k.heads);
  for (int64_t g = warp; g < groups; g += kWarps) {  // uniform over the warp
    const bool is_q = g < q_groups;
    const RopeOperand& op = is_q ? r.q : r.k;
    const int64_t h0 = hidden ? 0 : (is_q ? g : g - q_groups);
    const int64_t h1 = hidden ? op.heads : h0 + 1;
    const auto* base = static_cast<const scalar_t*>(op.in) + b * op.in_stride[0] + s * op.in_stride[1];
    const int64_t sd = op.in_stride[3];
    acc_t ss = 0;
    for (int64_t h = h0; h < h1; ++h) {
      const scalar_t* x = base + h * op.in_stride[2];
      for (int64_t e = lane; e < D; e += 32) {
        const acc_t v = static_cast<acc_t>(x[e * sd]);
        ss += v * v;
      }
    }
    const acc_t rr = math::qk_norm_inv_rms<acc_t>(warp_sum(ss), (h1 - h0) * D, eps);
    const acc_t* w = static_cast<const acc_t*>(is_q ? a.q_weight : a.k_weight);
    for (int64_t h = h0; h < h1; ++h) {
      const scalar_t* x = base + h * op.in_stride[2];
      const acc_t* wr = w + (hidden ? h * D : 0);
      const RowDestinations<scalar_t> out = row_destinations<scalar_t>(a, is_q, b, s, h, cached, outer, inner);
      for (int64_t p = lane; p < half; p += 32) {
        int64_t e1, e2;
        math::rope_pair_features(p, half, r.interleaved, &e1, &e2);
        e1 += begin;
        e2 += begin;
        const acc_t x1 = static_cast<acc_t>(x[e1 * sd]), x2 = static_cast<acc_t>(x[e2 * sd]);
        acc_t y1, y2;
        math::rope_rotate_pair(math::qk_norm_apply(x1, rr, wr[e1]), math::qk_norm_apply(x2, rr, wr[e2]),
                               cs[p], sn[p], &y1, &y2);
        out.store(e1, y1, a.k_format, k_scale);
        out.store(e2, y2, a.k_format, k_scale);
      }
      for (int64_t j = lane; j < pass; j += 32) {
        const int64_t f = math::rope_pass_feature(j, begin, r.rotary_dim);
        const acc_t y = math::qk_norm_apply(static_cast<acc_t>(x[f * sd]), rr, wr[f]);
        out.store(f, y, a.k_format, k_scale);
      }
    }
  }
}

template <typename scalar_t, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    rope_append_kv_kernel(const __grid_constant__ KvCacheArgs a) {
  using acc_t = cuda::opmath_t<scalar_t>;
  const RopeArgs& r = a.rope;
  const int64_t tokens = r.batch * r.seq;
  const int64_t half = r.rotary_dim / 2;
  const int64_t pass = r.head_dim - r.rotary_dim;
  const int64_t begin = math::rope_rotary_begin(r.settings);  // the rotary part's start
  const acc_t factor = static_cast<acc_t>(r.attention_factor);
  __shared__ acc_t s_cos[kMaxRopePairs];
  __shared__ acc_t s_sin[kMaxRopePairs];
  // Per head: half pairs, then pass features; q heads, then k heads; then v's elements.
  const int64_t per_head = half + pass;
  const int64_t q_items = r.q.heads * per_head;
  const int64_t k_items = r.k.heads * per_head;
  const int64_t items = q_items + k_items + r.k.heads * a.v_head_dim;
  const auto* q_in = static_cast<const scalar_t*>(r.q.in);
  const auto* k_in = static_cast<const scalar_t*>(r.k.in);
  const auto* v_in = static_cast<const scalar_t*>(a.v);
  auto* vc = static_cast<scalar_t*>(a.v_cache);
  // FP8 caches: values quantised with the cache's scale (kv_quantize: the float32 rotation,
  // divided, saturated, rounded to nearest even), stored as their bits.
  auto* vc8 = static_cast<uint8_t*>(a.v_cache);
  const bool k_fp8 = a.k_format != KvCacheFormat::kSame;
  const bool v_fp8 = a.v_format != KvCacheFormat::kSame;
  const float k_scale = a.k_scale_ptr != nullptr ? *a.k_scale_ptr : a.k_scale;
  const float v_scale = a.v_scale_ptr != nullptr ? *a.v_scale_ptr : a.v_scale;
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    CUDA_KERNEL_ASSERT_MSG(!k_fp8 || (k_scale > 0.0f && k_scale <= FLT_MAX),
                           "posenc: rope_append_kv: expected k_scale to be a finite positive number");
    CUDA_KERNEL_ASSERT_MSG(!v_fp8 || (v_scale > 0.0f && v_scale <= FLT_MAX),
                           "posenc: rope_append_kv: expected v_scale to be a finite positive number");
  }

  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    const int64_t b = token / r.seq;
    const int64_t s = token - b * r.seq;
    int64_t shift = 0, restart = 0;
    rope_token_shift(r, b, s, &shift, &restart);  // no packed sequences here: always true
    int64_t outer = 0, inner = 0;
    const bool cached = kv_cache_row(a, b, s, &outer, &inner);
    if (threadIdx.x == 0) {
      CUDA_KERNEL_ASSERT_MSG(cached || (a.slot_mapping != nullptr && a.slot_mapping[s] == -1),
                             "posenc: rope_append_kv: a cache row or slot_mapping slot out of "
                             "range (it was not written)");
      CUDA_KERNEL_ASSERT_MSG(rope_in_position_domain(shift - r.offset),
                             "posenc: rope_append_kv: expected offset within " POSENC_ROPE_POSITION_RANGE);
    }
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      const int64_t pos = rope_axis_position(r, b, s, shift, restart, r.pair_axis[i]);
      CUDA_KERNEL_ASSERT_MSG(rope_in_position_domain(pos - shift),
                             "posenc: rope_append_kv: expected positions within " POSENC_ROPE_POSITION_RANGE);
      acc_t sv, cv;
      math::rope_sincos<acc_t>(pos, r.inv_freq[i], &sv, &cv);
      s_cos[i] = cv * factor;
      s_sin[i] = sv * factor;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x + (kNorm ? q_items + k_items : 0); i < items; i += blockDim.x) {
      if (!kNorm && i < q_items + k_items) {
        const bool is_q = i < q_items;
        const int64_t j = is_q ? i : i - q_items;
        const int64_t h = j / per_head;
        const int64_t e = j - h * per_head;
        const RopeOperand& op = is_q ? r.q : r.k;
        const scalar_t* in = (is_q ? q_in : k_in) + b * op.in_stride[0] + s * op.in_stride[1] +
                             h * op.in_stride[2];
        const int64_t sd = op.in_stride[3];
        const RowDestinations<scalar_t> out = row_destinations<scalar_t>(a, is_q, b, s, h, cached, outer, inner);
        if (e < half) {
          int64_t e1, e2;
          math::rope_pair_features(e, half, r.interleaved, &e1, &e2);
          e1 += begin;
          e2 += begin;
          acc_t y1, y2;
          math::rope_rotate_pair(static_cast<acc_t>(in[e1 * sd]), static_cast<acc_t>(in[e2 * sd]),
                                 s_cos[e], s_sin[e], &y1, &y2);
          out.store(e1, y1, a.k_format, k_scale);
          out.store(e2, y2, a.k_format, k_scale);
        } else {
          const int64_t f = math::rope_pass_feature(e - half, begin, r.rotary_dim);
          const scalar_t x = in[f * sd];
          // In place, q's pass-through features are already where they belong.
          if (!(is_q && out.dst[0] == in && out.dsd[0] == sd)) out.store(f, x, a.k_format, k_scale);
        }
      } else if (cached) {
        const int64_t j = i - q_items - k_items;
        const int64_t h = j / a.v_head_dim;
        const int64_t e = j - h * a.v_head_dim;
        const int64_t at = outer * a.v_cache_stride[0] + inner * a.v_cache_stride[1] +
                           h * a.v_cache_stride[2] + e * a.v_cache_stride[3];
        const scalar_t x =
            v_in[b * a.v_stride[0] + s * a.v_stride[1] + h * a.v_stride[2] + e * a.v_stride[3]];
        if (v_fp8) {
          vc8[at] = kv_quantize(a.v_format, static_cast<float>(x), v_scale);
        } else {
          vc[at] = x;
        }
      }
    }
    if constexpr (kNorm) {  // q and k, after v (the loop above): fewer values live across it
      norm_rotate_token<scalar_t, acc_t>(a, b, s, cached, outer, inner, k_scale, s_cos, s_sin);
    }
    __syncthreads();  // the next token's cos/sin overwrite this one's
  }
}

}  // namespace

template <typename scalar_t>
cudaError_t launch_rope_append_kv(const KvCacheArgs& a, cudaStream_t stream) {
  const int64_t tokens = a.rope.batch * a.rope.seq;
  if (tokens == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>(tokens, 65535);
  auto kernel = a.q_weight != nullptr ? rope_append_kv_kernel<scalar_t, true> : rope_append_kv_kernel<scalar_t, false>;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_rope_append_kv, const KvCacheArgs&, cudaStream_t)

}  // namespace ops
}  // namespace posenc
