// CUDA kernels of qk_norm_rope and its backward.
//
// One warp per (token, operand): operand 0 is q, 1 is k. The warp's lanes compute the
// token's cos/sin (one pair each in turn; angle formed and reduced in float64 with
// posenc/math/rope.h, as the RoPE kernel) into the warp's slice of shared memory, then per
// normalised vector (a head, norm "head"; all heads of the operand, norm "hidden") the
// sum of squares over the lanes (a fixed butterfly of shuffles: deterministic), and each
// lane normalises, weights and rotates its pairs (posenc/math/qk_norm.h). Accesses are per
// element: lane p reads pairs p, p + 32, ..., so a warp's loads of one half are coalesced.
//
// The backward turns the incoming gradient back pair by pair, sums mean(g * xhat) over the
// vector with the same butterfly, writes dx in a second pass over the (cached) rows, and adds
// the weight-gradient terms gu * xhat into the warp's own row of a partial-sum buffer
// (rows: one per warp of the grid, a fixed grid: no atomics), which a second kernel sums
// over the rows in order. Results are deterministic for a given GPU and shape.
#include <algorithm>
#include <limits>

#include "../common/occupancy.cuh"
#include "../common/warp_reduce.cuh"
#include "../common/rope_device_checks.cuh"
#include "launch.h"
#include "posenc/math/qk_norm.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
using rope_cuda::warp_sum;

template <typename scalar_t>
__device__ __forceinline__ const scalar_t* in_row(const RopeOperand& op, int64_t b, int64_t s,
                                                  int64_t h) {
  return static_cast<const scalar_t*>(op.in) + b * op.in_stride[0] + s * op.in_stride[1] +
         h * op.in_stride[2];
}
template <typename scalar_t>
__device__ __forceinline__ scalar_t* out_row(const RopeOperand& op, int64_t b, int64_t s,
                                             int64_t h) {
  return static_cast<scalar_t*>(op.out) + b * op.out_stride[0] + s * op.out_stride[1] +
         h * op.out_stride[2];
}

// Sum of squares of heads [h0, h1) of the operand's token row, over the warp.
template <typename scalar_t, typename acc_t>
__device__ acc_t sum_squares(const RopeOperand& op, int64_t b, int64_t s, int64_t h0, int64_t h1,
                             int64_t D, int lane) {
  acc_t ss = 0;
  for (int64_t h = h0; h < h1; ++h) {
    const scalar_t* x = in_row<scalar_t>(op, b, s, h);
    for (int64_t e = lane; e < D; e += 32) {
      const acc_t v = static_cast<acc_t>(x[e * op.in_stride[3]]);
      ss += v * v;
    }
  }
  return warp_sum(ss);
}

// The features of pair p of a rotary part that starts at feature o.
__device__ __forceinline__ void pair_of(int64_t p, int64_t half, bool il, int64_t o, int64_t* e1,
                                        int64_t* e2) {
  math::rope_pair_features(p, half, il, e1, e2);
  *e1 += o;
  *e2 += o;
}

template <typename scalar_t, typename acc_t, bool kBackward>
// No minimum of blocks per SM: ptxas takes 158-168 registers (one block of 8 warps per SM);
// bounded to 128 (2 blocks) it spilled 168-332 bytes (tests/cpp/check_cuda_kernels.py
// reports this kernel). Untuned: no GPU was at hand to measure it.
__global__ void __launch_bounds__(kThreads)
    qk_norm_rope_kernel(const __grid_constant__ QkNormRopeArgs a, acc_t* dw_rows, int64_t dw_len) {
  const RopeArgs& ra = a.rope;
  __shared__ acc_t s_cos[kWarps][kMaxRopePairs];
  __shared__ acc_t s_sin[kWarps][kMaxRopePairs];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t global_warp = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t tokens = ra.batch * ra.seq;
  const int64_t half = ra.rotary_dim / 2, D = ra.head_dim;
  const int64_t o = math::rope_rotary_begin(ra.settings);  // the rotary part's start
  const bool hidden = a.norm == QkNorm::kHidden;
  const acc_t eps = static_cast<acc_t>(a.eps);
  const acc_t factor = static_cast<acc_t>(ra.attention_factor);
  const acc_t sign = ra.inverse ? acc_t(-1) : acc_t(1);
  acc_t* cs = s_cos[warp];
  acc_t* sn = s_sin[warp];
  rope_cuda::assert_cu_seqlens(ra);
  for (int64_t item = global_warp; item < 2 * tokens; item += warps) {
    const int64_t token = item >> 1;
    const bool is_q = (item & 1) == 0;
    const RopeOperand& op = is_q ? ra.q : ra.k;
    const RopeOperand& gop = is_q ? a.grad_q : a.grad_k;
    const acc_t* w = static_cast<const acc_t*>(is_q ? a.q_weight : a.k_weight);
    const int64_t H = op.heads;
    const int64_t b = token / ra.seq, s = token - (token / ra.seq) * ra.seq;
    if (H == 0 || D == 0) continue;
    int64_t shift = 0, restart = 0;
    const bool valid = rope_token_shift(ra, b, s, &shift, &restart);
    rope_cuda::assert_token_start(ra, valid, shift);  // as rope's kernel: never a silent NaN row
    if (!valid) {  // reached only with device asserts compiled out
      const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
      for (int64_t h = 0; h < H; ++h) {
        scalar_t* y = out_row<scalar_t>(op, b, s, h);
        for (int64_t e = lane; e < D; e += 32) y[e * op.out_stride[3]] = static_cast<scalar_t>(nan);
      }
      continue;
    }
    __syncwarp();  // the previous item's reads of cs / sn are done
    for (int64_t p = lane; p < half; p += 32) {
      const int64_t pos = rope_axis_position(ra, b, s, shift, restart, ra.pair_axis[p]);
      CUDA_KERNEL_ASSERT_MSG(rope_cuda::rope_in_position_domain(pos - shift),
                             "posenc: qk_norm_rope: expected positions within " POSENC_ROPE_POSITION_RANGE);
      acc_t sv, cv;
      math::rope_sincos<acc_t>(pos, ra.inv_freq[p], &sv, &cv);
      cs[p] = cv * factor;
      sn[p] = sv * factor * sign;
    }
    __syncwarp();
    acc_t* dw = kBackward ? dw_rows + global_warp * dw_len + (is_q ? 0 : dw_len / 2) : nullptr;
    const int64_t groups = hidden ? 1 : H;
    const int64_t per_group = hidden ? H : 1;
    const int64_t n = per_group * D;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t h0 = gi * per_group, h1 = h0 + per_group;
      const acc_t r = math::qk_norm_inv_rms<acc_t>(
          sum_squares<scalar_t, acc_t>(op, b, s, h0, h1, D, lane), n, eps);
      acc_t mean_gx = 0;
      if constexpr (kBackward) {
        // Pass A: sum of g * xhat (g = gu * w) and the weight-gradient terms.
        acc_t part = 0;
        for (int64_t h = h0; h < h1; ++h) {
          const scalar_t* x = in_row<scalar_t>(op, b, s, h);
          const scalar_t* g = in_row<scalar_t>(gop, b, s, h);
          const int64_t sx = op.in_stride[3], sg = gop.in_stride[3];
          const acc_t* wr = w + (hidden ? h * D : 0);
          acc_t* dwr = dw + (hidden ? h * D : 0);
          for (int64_t p = lane; p < half; p += 32) {
            int64_t e1, e2;
            pair_of(p, half, ra.interleaved, o, &e1, &e2);
            acc_t gu1, gu2;
            math::rope_rotate_pair(static_cast<acc_t>(g[e1 * sg]), static_cast<acc_t>(g[e2 * sg]),
                                   cs[p], sn[p], &gu1, &gu2);
            const acc_t xh1 = static_cast<acc_t>(x[e1 * sx]) * r;
            const acc_t xh2 = static_cast<acc_t>(x[e2 * sx]) * r;
            dwr[e1] += gu1 * xh1;
            dwr[e2] += gu2 * xh2;
            part += gu1 * wr[e1] * xh1 + gu2 * wr[e2] * xh2;
          }
          for (int64_t j = lane; j < D - 2 * half; j += 32) {
            const int64_t e = math::rope_pass_feature(j, o, 2 * half);
            const acc_t gu = static_cast<acc_t>(g[e * sg]);
            const acc_t xh = static_cast<acc_t>(x[e * sx]) * r;
            dwr[e] += gu * xh;
            part += gu * wr[e] * xh;
          }
        }
        mean_gx = warp_sum(part) / static_cast<acc_t>(n);
      }
      // Pass B: the outputs (forward) or dx (backward).
      for (int64_t h = h0; h < h1; ++h) {
        const scalar_t* x = in_row<scalar_t>(op, b, s, h);
        scalar_t* y = out_row<scalar_t>(op, b, s, h);
        const int64_t sx = op.in_stride[3], sy = op.out_stride[3];
        const acc_t* wr = w + (hidden ? h * D : 0);
        const scalar_t* g = kBackward ? in_row<scalar_t>(gop, b, s, h) : nullptr;
        const int64_t sg = gop.in_stride[3];
        for (int64_t p = lane; p < half; p += 32) {
          int64_t e1, e2;
          pair_of(p, half, ra.interleaved, o, &e1, &e2);
          const acc_t x1 = static_cast<acc_t>(x[e1 * sx]), x2 = static_cast<acc_t>(x[e2 * sx]);
          acc_t y1, y2;
          if constexpr (kBackward) {
            acc_t gu1, gu2;
            math::rope_rotate_pair(static_cast<acc_t>(g[e1 * sg]), static_cast<acc_t>(g[e2 * sg]),
                                   cs[p], sn[p], &gu1, &gu2);
            y1 = math::qk_norm_grad_input(gu1, wr[e1], x1 * r, mean_gx, r);
            y2 = math::qk_norm_grad_input(gu2, wr[e2], x2 * r, mean_gx, r);
          } else {
            math::rope_rotate_pair(math::qk_norm_apply(x1, r, wr[e1]), math::qk_norm_apply(x2, r, wr[e2]),
                                   cs[p], sn[p], &y1, &y2);
          }
          y[e1 * sy] = static_cast<scalar_t>(y1);
          y[e2 * sy] = static_cast<scalar_t>(y2);
        }
        for (int64_t j = lane; j < D - 2 * half; j += 32) {
          const int64_t e = math::rope_pass_feature(j, o, 2 * half);
          const acc_t xv = static_cast<acc_t>(x[e * sx]);
          acc_t yv;
          if constexpr (kBackward) {
            yv = math::qk_norm_grad_input(static_cast<acc_t>(g[e * sg]), wr[e], xv * r, mean_gx, r);
          } else {
            yv = math::qk_norm_apply(xv, r, wr[e]);
          }
          y[e * sy] = static_cast<scalar_t>(yv);
        }
      }
    }
  }
}

// out[e] = sum over rows of rows[row * len + e], rows in order.
template <typename acc_t>
__global__ void sum_rows_kernel(const acc_t* rows, int64_t n_rows, int64_t len, acc_t* out) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < len;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc_t s = 0;
    for (int64_t r = 0; r < n_rows; ++r) s += rows[r * len + e];
    out[e] = s;
  }
}

}  // namespace

template <typename scalar_t>
cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream) {
  const int64_t tokens = a.rope.batch * a.rope.seq;
  if (tokens == 0) return cudaSuccess;
  auto kernel = qk_norm_rope_kernel<scalar_t, cuda::opmath_t<scalar_t>, false>;
  int64_t wave = 0;
  POSENC_CUDA_TRY(cuda::resident_blocks(reinterpret_cast<const void*>(kernel), kThreads, &wave));
  const int64_t blocks = std::min<int64_t>((2 * tokens + kWarps - 1) / kWarps, wave);
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, nullptr, 0);
  return cudaGetLastError();
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_qk_norm_rope, const QkNormRopeArgs&, cudaStream_t)

// The backward's grid: enough blocks for the tokens, at most one wave, and at most ~64 MiB of
// partial rows; 0 rows without tokens.
template <typename scalar_t>
cudaError_t qk_norm_rope_backward_rows(const QkNormRopeArgs& a, int64_t lq, int64_t lk, int64_t* n_rows) {
  const int64_t tokens = a.rope.batch * a.rope.seq;
  *n_rows = 0;
  if (tokens == 0 || lq + lk == 0) return cudaSuccess;
  auto kernel = qk_norm_rope_kernel<scalar_t, cuda::opmath_t<scalar_t>, true>;
  int64_t wave = 0;
  POSENC_CUDA_TRY(cuda::resident_blocks(reinterpret_cast<const void*>(kernel), kThreads, &wave));
  const int64_t needed = (2 * tokens + kWarps - 1) / kWarps;
  // A partial row holds 2 * max(lq, lk) values (the host's row_len: q's sums, then k's).
  const int64_t cap = std::max<int64_t>(1, (int64_t{16} << 20) / (kWarps * 2 * std::max(lq, lk)));
  *n_rows = std::min<int64_t>({needed, cap, wave}) * kWarps;
  return cudaSuccess;
}
POSENC_CUDA_INSTANTIATE_FLOATING(qk_norm_rope_backward_rows, const QkNormRopeArgs&, int64_t, int64_t, int64_t*)

template <typename scalar_t>
cudaError_t launch_qk_norm_rope_backward(const QkNormRopeArgs& a, void* rows, int64_t n_rows, int64_t row_len,
                                         void* sums, cudaStream_t stream) {
  if (n_rows == 0) return cudaSuccess;
  using acc_t = cuda::opmath_t<scalar_t>;
  auto* partial = static_cast<acc_t*>(rows);
  qk_norm_rope_kernel<scalar_t, acc_t, true>
      <<<static_cast<unsigned>(n_rows / kWarps), kThreads, 0, stream>>>(a, partial, row_len);
  POSENC_CUDA_TRY(cudaGetLastError());
  const int64_t reduce_blocks = std::min<int64_t>((row_len + kThreads - 1) / kThreads, 1024);
  sum_rows_kernel<acc_t><<<static_cast<unsigned>(reduce_blocks), kThreads, 0, stream>>>(
      partial, n_rows, row_len, static_cast<acc_t*>(sums));
  return cudaGetLastError();
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_qk_norm_rope_backward, const QkNormRopeArgs&, void*, int64_t, int64_t, void*,
                                 cudaStream_t)

}  // namespace ops
}  // namespace posenc
