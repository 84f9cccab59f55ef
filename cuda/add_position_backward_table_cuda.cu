// CUDA kernel of add_position_backward_with_table for positions that depend on the
// sequence index only (offset, or (seq,) positions): one thread per (s, group of 8
// columns) walks the batch in order, writes grad_x = grad * mask * scale and sums the same
// values in registers, so grad is read once and each table entry gets a fixed-order sum
// (deterministic, no atomics). Without positions the sums land straight in their table
// rows (offset + s, all distinct); with (seq,) positions, which may repeat, they go to a
// (seq, d) buffer reduced into the table by index_put (sort based: deterministic too;
// unchecked out-of-range positions add nothing, see scatter_rows_into_table).
// (batch, seq) positions take the composite path (add_position_composite.cpp).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/add_position_checks.h"
#include "ops/kernels.h"
#include "posenc/math/philox.h"
#include "vector_access.cuh"

namespace posenc {
namespace ops {
namespace {

using cuda::is_aligned16;
using cuda::load_group;
using cuda::store_group;

constexpr int kThreads = 256;
constexpr int kGroup = math::kDropoutBlock;  // 8 columns per thread

struct TableBackwardArgs {
  int64_t batch, seq, d;
  bool batch_first;
  const int64_t* rng;  // (seed, offset) on the device; null when p == 0
  uint32_t threshold;
  double scale;
};

// kAligned: d % 8 == 0 and 16-byte aligned pointers, so a thread's 8 columns of a row are
// one Philox block and two 16-byte accesses at most.
template <typename scalar_t, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    add_position_backward_table_kernel(const scalar_t* __restrict__ grad,
                                       scalar_t* __restrict__ grad_x,
                                       at::opmath_type<scalar_t>* __restrict__ sums,
                                       TableBackwardArgs args) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t groups_per_row = (args.d + kGroup - 1) / kGroup;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (tid >= args.seq * groups_per_row) return;
  const int64_t s = tid / groups_per_row;
  const int64_t j0 = (tid - s * groups_per_row) * kGroup;
  const bool dropout = args.rng != nullptr;
  const uint64_t seed = dropout ? static_cast<uint64_t>(args.rng[0]) : 0;
  const uint64_t offset = dropout ? static_cast<uint64_t>(args.rng[1]) : 0;
  const acc_t scale = static_cast<acc_t>(args.scale);

  acc_t acc[kGroup];
#pragma unroll
  for (int k = 0; k < kGroup; ++k) acc[k] = acc_t(0);

  for (int64_t b = 0; b < args.batch; ++b) {  // batch order: the fixed summation order
    const int64_t row = args.batch_first ? b * args.seq + s : s * args.batch + b;
    const int64_t e0 = row * args.d + j0;
    if (kAligned) {
      acc_t v[kGroup];
      load_group<scalar_t, acc_t>(grad + e0, v);
      if (dropout) {
        const math::Philox4x32 bits = math::dropout_block_bits(seed, offset, e0 / kGroup);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          v[k] *= math::dropout_lane_bits(bits, k) >= args.threshold ? scale : acc_t(0);
        }
      }
      if (grad_x != nullptr) store_group<scalar_t, acc_t>(grad_x + e0, v);
#pragma unroll
      for (int k = 0; k < kGroup; ++k) acc[k] += v[k];
    } else {
      // Any d: element by element, one Philox call per dropout block touched.
      uint64_t block = ~uint64_t{0};
      math::Philox4x32 bits{};
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        if (j0 + k >= args.d) break;
        const int64_t e = e0 + k;
        acc_t v = static_cast<acc_t>(grad[e]);
        if (dropout) {
          const uint64_t e_block = static_cast<uint64_t>(e) / kGroup;
          if (e_block != block) {
            bits = math::dropout_block_bits(seed, offset, e_block);
            block = e_block;
          }
          v *= math::dropout_lane_bits(bits, static_cast<int>(e % kGroup)) >= args.threshold
                   ? scale
                   : acc_t(0);
        }
        if (grad_x != nullptr) grad_x[e] = static_cast<scalar_t>(v);
        acc[k] += v;
      }
    }
  }
  acc_t* out = sums + s * args.d + j0;
#pragma unroll
  for (int k = 0; k < kGroup; ++k) {
    if (j0 + k < args.d) out[k] = acc[k];
  }
}

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_cuda(
    const at::Tensor& grad_in, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, int64_t table_len, bool need_x) {
  const AddPositionGeometry g = check_add_position_backward_inputs(
      grad_in, rng, positions, offset, batch_first, p, table_len);
  if (positions.has_value() && positions->dim() == 2) {
    return add_position_backward_with_table_composite(grad_in, rng, positions, offset,
                                                      batch_first, p, table_len, need_x);
  }
  const c10::cuda::CUDAGuard device_guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::ScalarType acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_x = need_x ? at::empty(grad.sizes(), grad.options())
                             : at::empty({0}, grad.options());
  at::Tensor grad_table = positions.has_value()
                             ? at::Tensor()
                             : at::zeros({table_len, g.d}, grad.options().dtype(acc));
  if (grad.numel() == 0) {
    return {grad_x, at::zeros({table_len, g.d}, grad.options().dtype(acc))};
  }
  // Sums per s: straight into rows offset + s of the table, or into a buffer when the
  // (seq,) positions may send two s to one row.
  at::Tensor sums = positions.has_value() ? at::empty({g.seq, g.d}, grad.options().dtype(acc))
                                          : grad_table.narrow(0, offset, g.seq);
  const auto params = math::make_dropout_params(p);
  const at::Tensor state = p > 0.0 ? rng.contiguous() : at::Tensor();
  TableBackwardArgs args{g.batch, g.seq, g.d, g.batch_first,
                         p > 0.0 ? state.const_data_ptr<int64_t>() : nullptr, params.threshold,
                         params.scale};
  const int64_t threads = g.seq * ((g.d + kGroup - 1) / kGroup);
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_add_position_backward_table_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        scalar_t* gx = need_x ? grad_x.mutable_data_ptr<scalar_t>() : nullptr;
        const bool aligned = g.d % kGroup == 0 && is_aligned16(grad.const_data_ptr()) &&
                             (gx == nullptr || is_aligned16(gx));
        auto kernel = aligned ? add_position_backward_table_kernel<scalar_t, true>
                              : add_position_backward_table_kernel<scalar_t, false>;
        kernel<<<blocks, kThreads, 0, stream>>>(grad.const_data_ptr<scalar_t>(), gx,
                                                sums.mutable_data_ptr<acc_t>(), args);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  if (positions.has_value()) {
    grad_table = scatter_rows_into_table(positions->contiguous(), sums, table_len);
  }
  return {grad_x, grad_table};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("add_position_backward_with_table", &add_position_backward_with_table_cuda);
}

}  // namespace ops
}  // namespace posenc
