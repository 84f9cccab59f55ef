// CUDA kernel of apply_rope_cos_sin. One thread per (token, head, rotary pair) of q and then
// k (grid-stride), plus the pass-through features of partial rotary; the rotation is
// math::rope_rotate_pair_tables, as on the CPU, in float32 (float64 for float64). The
// tables (already in the compute dtype, contiguous (table_batch, seq, rotary_dim)) are
// read through the read-only cache: every head of a token reads the same row. Element
// accesses with any strides; no host-device synchronisation.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "ops/rope/rope_cos_sin.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace {

constexpr int kThreads = 256;

// Work item i of one operand: (token, head, slot), slot < half a pair, half <= slot <
// half + (head_dim - rotary_dim) a pass-through feature.
template <typename scalar_t>
__device__ __forceinline__ void rotate_item(const RopeCosSinArgs& a, const RopeOperand& op,
                                            int64_t i) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t half = a.rotary_dim / 2;
  const int64_t slots = half + (a.head_dim - a.rotary_dim);
  const int64_t slot = i % slots;
  const int64_t h = (i / slots) % op.heads;
  const int64_t t = i / (slots * op.heads);
  const int64_t b = t / a.seq, s = t % a.seq;
  const auto* x = static_cast<const scalar_t*>(op.in) + b * op.in_stride[0] + s * op.in_stride[1] +
                  h * op.in_stride[2];
  auto* y = static_cast<scalar_t*>(op.out) + b * op.out_stride[0] + s * op.out_stride[1] +
            h * op.out_stride[2];
  if (slot >= half) {  // partial rotary: copied through
    const int64_t e = a.rotary_dim + (slot - half);
    y[e * op.out_stride[3]] = x[e * op.in_stride[3]];
    return;
  }
  const auto* cs = static_cast<const acc_t*>(a.cos) + b * a.table_batch_stride + s * a.rotary_dim;
  const auto* sn = static_cast<const acc_t*>(a.sin) + b * a.table_batch_stride + s * a.rotary_dim;
  int64_t e1, e2;
  math::rope_pair_features(slot, half, a.interleaved, &e1, &e2);
  acc_t y1, y2;
  math::rope_rotate_pair_tables<acc_t>(
      static_cast<acc_t>(x[e1 * op.in_stride[3]]), static_cast<acc_t>(x[e2 * op.in_stride[3]]),
      __ldg(cs + e1), __ldg(sn + e1), __ldg(cs + e2), __ldg(sn + e2), a.transpose, &y1, &y2);
  y[e1 * op.out_stride[3]] = static_cast<scalar_t>(y1);
  y[e2 * op.out_stride[3]] = static_cast<scalar_t>(y2);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    rope_cos_sin_kernel(const __grid_constant__ RopeCosSinArgs a, int64_t items_q, int64_t items) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    if (i < items_q) {
      rotate_item<scalar_t>(a, a.q, i);
    } else {
      rotate_item<scalar_t>(a, a.k, i - items_q);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_cuda(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  const bool bhsd = check_rope_cos_sin(q, k, cos, sin, std::string(layout));
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out_q = at::empty_like(q);
  std::optional<at::Tensor> out_k;
  if (k.has_value()) out_k = at::empty_like(*k);
  const RopeCosSinLaunch launch =
      prepare_rope_cos_sin(q, k, cos, sin, bhsd, interleaved, transpose, out_q, out_k);
  const RopeCosSinArgs& a = launch.args;
  const int64_t slots = a.rotary_dim / 2 + (a.head_dim - a.rotary_dim);
  const int64_t items_q = a.batch * a.seq * a.q.heads * slots;
  const int64_t items = items_q + a.batch * a.seq * a.k.heads * slots;
  if (items > 0) {
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t blocks = std::min<int64_t>((items + kThreads - 1) / kThreads, sms * 8);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, q.scalar_type(), "posenc_apply_rope_cos_sin_cuda", [&] {
          rope_cos_sin_kernel<scalar_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
              a, items_q, items);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }
  return {out_q, out_k.has_value() ? *out_k : at::empty({0}, q.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) { m.impl("apply_rope_cos_sin", &apply_rope_cos_sin_cuda); }

}  // namespace ops
}  // namespace posenc
