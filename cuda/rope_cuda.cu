// CUDA kernels of the rope ops (out of place and in place; the backward is the same kernel
// with inverse=true).
//
// A block handles one token at a time (grid-stride over tokens). The token's cos/sin are
// evaluated once per block into shared memory, one pair per thread (from the token's
// coordinate on the pair's axis: multi-axis RoPE), with the shared math of
// posenc/math/rope.h (angle formed and reduced in float64, so accurate at any position).
// Thread t then owns a chunk of P consecutive pairs (c = t % chunks) and a head lane
// (t / chunks), and walks the heads of q and k at stride `head_lanes`. On the fast path (last dimension contiguous, 16-byte aligned
// rows, rotary_dim/2 a multiple of P) each chunk is one 16-byte load per half (rotate_half
// layout) or two consecutive ones (interleaved layout); otherwise P = 1 with element loads
// and any strides. The frequencies travel in the kernel parameters (__grid_constant__, no
// copy); no host-device synchronisation anywhere.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "vector_access.cuh"
#include "ops/rope/rope_launch.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace {

using cuda::Pack;

constexpr int kMaxThreads = 256;

// Loads P pairs (x1[k], x2[k]) starting at pair p0 of a row.
template <typename scalar_t, typename acc_t, int P, bool kVec>
__device__ __forceinline__ void load_pairs(const scalar_t* row, int64_t sd, int64_t half,
                                           bool interleaved, int64_t p0, acc_t (&x1)[P],
                                           acc_t (&x2)[P]) {
  if constexpr (kVec) {
    if (!interleaved) {
      const Pack<scalar_t, P> a = *reinterpret_cast<const Pack<scalar_t, P>*>(row + p0);
      const Pack<scalar_t, P> b = *reinterpret_cast<const Pack<scalar_t, P>*>(row + half + p0);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        x1[k] = static_cast<acc_t>(a.v[k]);
        x2[k] = static_cast<acc_t>(b.v[k]);
      }
    } else {
      const Pack<scalar_t, P> a = *reinterpret_cast<const Pack<scalar_t, P>*>(row + 2 * p0);
      const Pack<scalar_t, P> b = *reinterpret_cast<const Pack<scalar_t, P>*>(row + 2 * p0 + P);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const scalar_t e1 = k < P / 2 ? a.v[2 * k] : b.v[2 * k - P];
        const scalar_t e2 = k < P / 2 ? a.v[2 * k + 1] : b.v[2 * k + 1 - P];
        x1[k] = static_cast<acc_t>(e1);
        x2[k] = static_cast<acc_t>(e2);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      int64_t e1, e2;
      math::rope_pair_features(p0 + k, half, interleaved, &e1, &e2);
      x1[k] = static_cast<acc_t>(row[e1 * sd]);
      x2[k] = static_cast<acc_t>(row[e2 * sd]);
    }
  }
}

template <typename scalar_t, typename acc_t, int P, bool kVec>
__device__ __forceinline__ void store_pairs(scalar_t* row, int64_t sd, int64_t half,
                                            bool interleaved, int64_t p0, const acc_t (&y1)[P],
                                            const acc_t (&y2)[P]) {
  if constexpr (kVec) {
    Pack<scalar_t, P> a, b;
    if (!interleaved) {
#pragma unroll
      for (int k = 0; k < P; ++k) {
        a.v[k] = static_cast<scalar_t>(y1[k]);
        b.v[k] = static_cast<scalar_t>(y2[k]);
      }
      *reinterpret_cast<Pack<scalar_t, P>*>(row + p0) = a;
      *reinterpret_cast<Pack<scalar_t, P>*>(row + half + p0) = b;
    } else {
#pragma unroll
      for (int k = 0; k < P; ++k) {
        scalar_t* dst = k < P / 2 ? &a.v[2 * k] : &b.v[2 * k - P];
        dst[0] = static_cast<scalar_t>(y1[k]);
        dst[1] = static_cast<scalar_t>(y2[k]);
      }
      *reinterpret_cast<Pack<scalar_t, P>*>(row + 2 * p0) = a;
      *reinterpret_cast<Pack<scalar_t, P>*>(row + 2 * p0 + P) = b;
    }
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      int64_t e1, e2;
      math::rope_pair_features(p0 + k, half, interleaved, &e1, &e2);
      row[e1 * sd] = static_cast<scalar_t>(y1[k]);
      row[e2 * sd] = static_cast<scalar_t>(y2[k]);
    }
  }
}

template <typename scalar_t, int P, bool kVec>
__global__ void __launch_bounds__(kMaxThreads)
    rope_kernel(const __grid_constant__ RopeArgs a, int chunks, int head_lanes) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t tokens = a.batch * a.seq;
  const int64_t half = a.rotary_dim / 2;
  const int64_t heads = a.q.heads + a.k.heads;
  const int64_t pass = a.head_dim - a.rotary_dim;
  const int c = threadIdx.x % chunks;
  const int lane = threadIdx.x / chunks;
  const int64_t p0 = static_cast<int64_t>(c) * P;
  const acc_t factor = static_cast<acc_t>(a.attention_factor);
  const acc_t sign = a.inverse ? acc_t(-1) : acc_t(1);
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  // The frequencies, then each token's cos/sin, live in shared memory: a token's half
  // pairs are evaluated once per block (one per thread), not once per head lane.
  __shared__ double s_freq[kMaxRopePairs];
  __shared__ acc_t s_cos[kMaxRopePairs];
  __shared__ acc_t s_sin[kMaxRopePairs];
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) s_freq[i] = a.inv_freq[i];

  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    const int64_t b = token / a.seq;
    const int64_t s = token - b * a.seq;
    int64_t shift = 0, restart = 0;
    const bool valid = rope_token_shift(a, b, s, &shift, &restart);  // the same for the block
    __syncthreads();  // s_freq written (first token); the previous token's readers are done
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      acc_t sv = nan, cv = nan;
      if (valid) {
        const int64_t pos = rope_axis_position(a, b, s, shift, restart, a.pair_axis[i]);
        math::rope_sincos<acc_t>(pos, s_freq[i], &sv, &cv);
      }
      s_cos[i] = cv * factor;
      s_sin[i] = sv * factor * sign;
    }
    __syncthreads();
    if (lane < head_lanes) {
      acc_t cs[P], sn[P];
#pragma unroll
      for (int k = 0; k < P; ++k) {
        cs[k] = s_cos[p0 + k];
        sn[k] = s_sin[p0 + k];
      }
      for (int64_t h = lane; h < heads; h += head_lanes) {
        const bool is_q = h < a.q.heads;
        const RopeOperand& op = is_q ? a.q : a.k;
        const int64_t hh = is_q ? h : h - a.q.heads;
        const scalar_t* in = static_cast<const scalar_t*>(op.in) + b * op.in_stride[0] +
                             s * op.in_stride[1] + hh * op.in_stride[2];
        scalar_t* out = static_cast<scalar_t*>(op.out) + b * op.out_stride[0] +
                        s * op.out_stride[1] + hh * op.out_stride[2];
        acc_t x1[P], x2[P], y1[P], y2[P];
        load_pairs<scalar_t, acc_t, P, kVec>(in, op.in_stride[3], half, a.interleaved, p0, x1, x2);
#pragma unroll
        for (int k = 0; k < P; ++k) {
          math::rope_rotate_pair(x1[k], x2[k], cs[k], sn[k], &y1[k], &y2[k]);
        }
        store_pairs<scalar_t, acc_t, P, kVec>(out, op.out_stride[3], half, a.interleaved, p0, y1,
                                              y2);
      }
    }
    // Features beyond rotary_dim pass through (nothing to do in place, unless invalid).
    // Both operands are asked: a q without elements has in == out == nullptr even out of
    // place, and k's pass-through features must still be copied then.
    if (pass > 0 && (a.q.in != a.q.out || a.k.in != a.k.out || !valid)) {
      for (int64_t e = threadIdx.x; e < heads * pass; e += blockDim.x) {
        const int64_t h = e / pass;
        const int64_t j = a.rotary_dim + (e - h * pass);
        const bool is_q = h < a.q.heads;
        const RopeOperand& op = is_q ? a.q : a.k;
        const int64_t hh = is_q ? h : h - a.q.heads;
        const scalar_t* in = static_cast<const scalar_t*>(op.in) + b * op.in_stride[0] +
                             s * op.in_stride[1] + hh * op.in_stride[2] + j * op.in_stride[3];
        scalar_t* out = static_cast<scalar_t*>(op.out) + b * op.out_stride[0] +
                        s * op.out_stride[1] + hh * op.out_stride[2] + j * op.out_stride[3];
        *out = valid ? *in : static_cast<scalar_t>(nan);
      }
    }
  }
}

// The 16-byte path needs every row of q and k (in and out) contiguous and aligned, and
// whole chunks of P pairs.
bool can_vectorize(const RopeArgs& a, int64_t P) {
  if ((a.rotary_dim / 2) % P != 0) return false;
  for (const RopeOperand* op : {&a.q, &a.k}) {
    if (op->heads == 0) continue;
    if (op->in_stride[3] != 1 || op->out_stride[3] != 1) return false;
    if (!cuda::is_aligned16(op->in) || !cuda::is_aligned16(op->out)) return false;
    for (int d = 0; d < 3; ++d) {
      if (op->in_stride[d] % P != 0 || op->out_stride[d] % P != 0) return false;
    }
  }
  return true;
}

template <typename scalar_t, int P, bool kVec>
void launch(const RopeArgs& a) {
  const int64_t half = a.rotary_dim / 2;
  const int64_t heads = a.q.heads + a.k.heads;
  const int chunks = static_cast<int>(std::max<int64_t>(1, (half + P - 1) / P));
  const int head_lanes =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(heads, kMaxThreads / chunks)));
  const int threads = chunks * head_lanes;
  const int64_t tokens = a.batch * a.seq;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>(tokens, static_cast<int64_t>(sms) * 32);
  rope_kernel<scalar_t, P, kVec><<<static_cast<unsigned>(blocks), threads, 0,
                                   at::cuda::getCurrentCUDAStream()>>>(a, chunks, head_lanes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_rope_cuda(const RopeLaunch& l, const at::Tensor& q) {
  const RopeArgs& a = l.args;
  if (a.batch * a.seq == 0 || a.q.heads + a.k.heads == 0 || a.head_dim == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());  // current stream and properties of q's GPU
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "posenc_rope_cuda", [&] {
    constexpr int P = cuda::kPerVector<scalar_t>;
    if (can_vectorize(a, P)) {
      launch<scalar_t, P, true>(a);
    } else {
      launch<scalar_t, 1, false>(a);
    }
  });
}

at::Tensor empty_like_input(const at::Tensor& like) { return at::empty_like(like); }

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<
                     &rope_kernel_boxed<&empty_like_input, &run_rope_cuda>>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<
                      &rope_inplace_kernel_boxed<&empty_like_input, &run_rope_cuda>>());
}

}  // namespace ops
}  // namespace posenc
