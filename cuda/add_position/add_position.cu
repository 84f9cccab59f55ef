// CUDA kernels of add_position_forward / add_position_backward.
//
// One thread handles a group of 8 consecutive output elements per step: exactly one
// Philox call (see posenc/math/philox.h) and, on the fast path, 16-byte loads and stores.
// The fast path needs d % 8 == 0 (a group never straddles two rows) and 16-byte aligned
// pointers; offset views and odd sizes take the element-wise path, which draws the same
// mask. Indices are 32-bit when the tensor allows, 64-bit otherwise.
//
// The dropout (seed, offset) comes from the device's default generator as a
// PhiloxCudaState, unpacked inside the kernel (so CUDA graph capture works), and the
// kernel writes the pair to the small `rng` output that backward reads on the device:
// no host-device synchronisation anywhere.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <mutex>

#include "../common/occupancy.cuh"
#include "../common/vector_access.cuh"
#include "ops/add_position/add_position.h"
#include "posenc/math/philox.h"

namespace posenc {
namespace ops {
namespace {

using cuda::is_aligned16;
using cuda::store_group;
using at::cuda::detail::IntDivider;

constexpr int kThreads = 256;
constexpr int kGroup = math::kDropoutBlock;

template <typename index_t>
struct RowMap {
  IntDivider<index_t> d;      // element -> (row, column)
  IntDivider<index_t> inner;  // row -> (outer, inner): (b, s) or (s, b)
  bool batch_first;
  const int64_t* positions;  // null: position = offset + s
  int64_t positions_batch_stride;
  int64_t offset;
  int64_t table_len;

  // Table row for output row `row`. A position outside [0, table_len) stops the kernel with
  // a device-side assert (the CPU kernel's IndexError; ATen's indexing does the same): the
  // error surfaces at the next synchronisation, and the CUDA context is unusable after it.
  // Checked on the device so that the default call needs no host sync (graph capture).
  __device__ __forceinline__ int64_t position(index_t row) const {
    const auto qr = inner.divmod(row);
    const index_t b = batch_first ? qr.div : qr.mod;
    const index_t s = batch_first ? qr.mod : qr.div;
    const int64_t pos = positions != nullptr
                            ? positions[static_cast<int64_t>(b) * positions_batch_stride + s]
                            : offset + static_cast<int64_t>(s);
    CUDA_KERNEL_ASSERT_MSG(pos >= 0 && pos < table_len,
                           "posenc: add_position: a position is outside [0, max_len) of the table");
    return pos;
  }
};

struct CudaDropoutArgs {
  at::PhiloxCudaState philox;
  uint32_t threshold;
  double scale;
  bool active;
};

template <typename acc_t>
__device__ __forceinline__ void dropout_factors(uint64_t seed, uint64_t offset, uint64_t group,
                                                uint32_t threshold, acc_t scale,
                                                acc_t (&factors)[kGroup]) {
  const math::Philox4x32 bits = math::dropout_block_bits(seed, offset, group);
#pragma unroll
  for (int k = 0; k < kGroup; ++k) {
    factors[k] = math::dropout_lane_bits(bits, k) >= threshold ? scale : acc_t(0);
  }
}

// Fast path: kUnroll<scalar_t> groups per thread and step, all their loads issued before
// the arithmetic (the Philox rounds of the dropout mask run while the loads are in flight):
// two for 16-bit types, one for float32 and float64, whose group is already two or four
// 16-byte loads, so every thread has at least 32 bytes of x in flight (more spilled).
// Register budget: kMinBlocksPerSm = 4 blocks of 256 threads (64 registers a thread). At 40
// (6 blocks) ptxas spilled the second group; 1024 threads x 32 bytes of x is 32 KiB of HBM
// loads in flight per SM, above the ~26 KiB Little's law asks at 4.3 TB/s, where one bf16
// group at 6 blocks gives 24 KiB.
template <typename T>
constexpr int kUnroll = sizeof(T) == 2 ? 2 : 1;
constexpr int kMinBlocksPerSm = 4;

template <typename scalar_t, typename table_t, typename index_t, bool kVectorized>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    add_position_forward_kernel(const scalar_t* __restrict__ x, const table_t* __restrict__ table,
                                scalar_t* __restrict__ out, index_t numel, RowMap<index_t> map,
                                CudaDropoutArgs dropout, int64_t* __restrict__ rng_out) {
  using acc_t = at::opmath_type<scalar_t>;
  uint64_t seed = 0, offset = 0;
  if (dropout.active) {
    const auto state = at::cuda::philox::unpack(dropout.philox);
    seed = std::get<0>(state);
    offset = std::get<1>(state);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      rng_out[0] = static_cast<int64_t>(seed);
      rng_out[1] = static_cast<int64_t>(offset);
    }
  }
  const acc_t scale = static_cast<acc_t>(dropout.scale);
  const index_t groups = (numel + kGroup - 1) / kGroup;
  const index_t stride = static_cast<index_t>(gridDim.x) * kThreads;
  if constexpr (kVectorized) {
    for (index_t g0 = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; g0 < groups;
         g0 += stride * kUnroll<scalar_t>) {
      cuda::RawGroup<scalar_t> xs[kUnroll<scalar_t>];
      cuda::RawGroup<table_t> ts[kUnroll<scalar_t>];
#pragma unroll
      for (int u = 0; u < kUnroll<scalar_t>; ++u) {
        const index_t g = g0 + u * stride;
        if (g < groups) {
          const index_t e0 = g * kGroup;
          const auto rc = map.d.divmod(e0);
          const int64_t pos = map.position(rc.div);
          xs[u] = cuda::load_raw_group(x + e0);
          ts[u] = cuda::load_raw_group(table + pos * map.d.divisor + rc.mod);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll<scalar_t>; ++u) {
        const index_t g = g0 + u * stride;
        if (g >= groups) break;
        acc_t v[kGroup], t[kGroup], factors[kGroup];
        cuda::convert_group(xs[u], v);
        cuda::convert_group(ts[u], t);
        if (dropout.active) {
          dropout_factors<acc_t>(seed, offset, g, dropout.threshold, scale, factors);
        }
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          v[k] += t[k];
          if (dropout.active) v[k] *= factors[k];
        }
        store_group<scalar_t, acc_t>(out + g * kGroup, v);
      }
    }
  } else {
    for (index_t g = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; g < groups;
         g += stride) {
      acc_t factors[kGroup];
      if (dropout.active) {
        dropout_factors<acc_t>(seed, offset, g, dropout.threshold, scale, factors);
      }
      const index_t e0 = g * kGroup;
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        const index_t e = e0 + k;
        if (e >= numel) break;
        const auto rc = map.d.divmod(e);
        const int64_t pos = map.position(rc.div);
        acc_t v = static_cast<acc_t>(x[e]) + static_cast<acc_t>(table[pos * map.d.divisor + rc.mod]);
        if (dropout.active) v *= factors[k];
        out[e] = static_cast<scalar_t>(v);
      }
    }
  }
}

// The dropout backward: grad * mask * scale, the mask drawn again from (seed, offset).
// Same shape as the forward's fast path: kUnroll groups, loads before the Philox rounds.
template <typename scalar_t, typename index_t, bool kVectorized>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    add_position_backward_kernel(const scalar_t* __restrict__ grad, scalar_t* __restrict__ out,
                                 index_t numel, const int64_t* __restrict__ rng,
                                 uint32_t threshold, double scale_d) {
  using acc_t = at::opmath_type<scalar_t>;
  const uint64_t seed = static_cast<uint64_t>(rng[0]);
  const uint64_t offset = static_cast<uint64_t>(rng[1]);
  const acc_t scale = static_cast<acc_t>(scale_d);
  const index_t groups = (numel + kGroup - 1) / kGroup;
  const index_t stride = static_cast<index_t>(gridDim.x) * kThreads;
  for (index_t g0 = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; g0 < groups;
       g0 += stride * kUnroll<scalar_t>) {
    cuda::RawGroup<scalar_t> raw[kUnroll<scalar_t>];
    bool whole[kUnroll<scalar_t>];
#pragma unroll
    for (int u = 0; u < kUnroll<scalar_t>; ++u) {
      const index_t g = g0 + u * stride;
      whole[u] = kVectorized && g < groups && g * kGroup + kGroup <= numel;
      if (whole[u]) raw[u] = cuda::load_raw_group(grad + g * kGroup);
    }
#pragma unroll
    for (int u = 0; u < kUnroll<scalar_t>; ++u) {
      const index_t g = g0 + u * stride;
      if (g >= groups) break;
      acc_t factors[kGroup];
      dropout_factors<acc_t>(seed, offset, g, threshold, scale, factors);
      const index_t e0 = g * kGroup;
      if (whole[u]) {
        acc_t v[kGroup];
        cuda::convert_group(raw[u], v);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) v[k] *= factors[k];
        store_group<scalar_t, acc_t>(out + e0, v);
      } else {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          const index_t e = e0 + k;
          if (e >= numel) break;
          out[e] = static_cast<scalar_t>(static_cast<acc_t>(grad[e]) * factors[k]);
        }
      }
    }
  }
}

// One wave of resident blocks (the kernels are grid-stride; cuda::resident_blocks), or
// fewer when the tensor needs fewer, each thread given kUnroll groups a step.
template <typename scalar_t, typename Kernel>
int64_t grid_for(Kernel kernel, int64_t numel) {
  const int64_t groups = (numel + kGroup - 1) / kGroup;
  constexpr int64_t per_block = kThreads * kUnroll<scalar_t>;
  const int64_t wanted = (groups + per_block - 1) / per_block;
  const int64_t wave = cuda::resident_blocks(reinterpret_cast<const void*>(kernel), kThreads);
  return std::max<int64_t>(1, std::min<int64_t>(wanted, wave));
}

template <typename scalar_t, typename table_t, typename index_t>
void launch_forward(const at::Tensor& x, const at::Tensor& table, const at::Tensor& pos,
                    const AddPositionArgs& g, const CudaDropoutArgs& dropout, at::Tensor& out,
                    at::Tensor& rng) {
  RowMap<index_t> map{IntDivider<index_t>(static_cast<index_t>(g.d)),
                      IntDivider<index_t>(static_cast<index_t>(g.batch_first ? g.seq : g.batch)),
                      g.batch_first,
                      pos.defined() ? pos.const_data_ptr<int64_t>() : nullptr,
                      g.positions_batch_stride,
                      g.offset,
                      g.table_len};
  const bool vectorized = g.d % kGroup == 0 && is_aligned16(x.const_data_ptr()) &&
                          is_aligned16(out.const_data_ptr()) &&
                          is_aligned16(table.const_data_ptr());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const index_t numel = static_cast<index_t>(x.numel());
  int64_t* rng_ptr = dropout.active ? rng.mutable_data_ptr<int64_t>() : nullptr;
  auto kernel = vectorized ? add_position_forward_kernel<scalar_t, table_t, index_t, true>
                           : add_position_forward_kernel<scalar_t, table_t, index_t, false>;
  kernel<<<grid_for<scalar_t>(kernel, x.numel()), kThreads, 0, stream>>>(
      x.const_data_ptr<scalar_t>(), table.const_data_ptr<table_t>(),
      out.mutable_data_ptr<scalar_t>(), numel, map, dropout, rng_ptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// 32-bit indices when they fit: element indices are formed only for groups below `groups`
// (so below numel + kGroup), group indices stay below groups + kUnroll strides (a stride is
// at most one group per thread of the grid), far inside 32 bits.
bool fits_int32(int64_t numel) {
  return numel + kGroup * static_cast<int64_t>(kThreads) * 2 <
         std::numeric_limits<int32_t>::max();
}

std::tuple<at::Tensor, at::Tensor> add_position_forward_cuda(
    const at::Tensor& x_in, const at::Tensor& table_in, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, bool save_mask) {
  TORCH_CHECK_VALUE(!save_mask, "posenc: add_position_forward: save_mask=True (a saved dropout "
                    "mask) is CPU-only; on CUDA the backward regenerates the mask from rng");
  const AddPositionArgs g =
      check_add_position_inputs(x_in, table_in, positions, offset, batch_first, p);
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor table = table_as_matrix(table_in, x.scalar_type());
  const at::Tensor pos = positions.has_value() ? positions->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());

  CudaDropoutArgs dropout{};
  // An empty x has no mask to draw (and backward never reads its rng).
  dropout.active = p > 0.0 && x.numel() > 0;
  at::Tensor rng = at::empty({dropout.active ? 2 : 0}, x.options().dtype(at::kLong));
  if (dropout.active) {
    const auto params = math::make_dropout_params(p);
    dropout.threshold = params.threshold;
    dropout.scale = params.scale;
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(x.device().index()));
    std::lock_guard<std::mutex> lock(gen->mutex_);
    // One 128-bit Philox draw per block of 8 elements, each block its own subsequence (see
    // posenc/math/philox.h): 4 offsets, as a torch kernel whose threads draw once.
    dropout.philox = gen->philox_cuda_state(4);
  }
  if (x.numel() == 0) {
    if (p > 0.0) rng = at::zeros({2}, x.options().dtype(at::kLong));
    return {out, rng};
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "posenc_add_position_cuda", [&] {
        using wide_t = at::opmath_type<scalar_t>;
        const bool same = table.scalar_type() == x.scalar_type();
        if (fits_int32(x.numel())) {
          if (same) launch_forward<scalar_t, scalar_t, uint32_t>(x, table, pos, g, dropout, out, rng);
          else launch_forward<scalar_t, wide_t, uint32_t>(x, table, pos, g, dropout, out, rng);
        } else {
          if (same) launch_forward<scalar_t, scalar_t, uint64_t>(x, table, pos, g, dropout, out, rng);
          else launch_forward<scalar_t, wide_t, uint64_t>(x, table, pos, g, dropout, out, rng);
        }
      });
  return {out, rng};
}

at::Tensor add_position_backward_cuda(const at::Tensor& grad_in, const at::Tensor& rng,
                                      double p) {
  check_dropout_backward_args(grad_in, rng, p);
  const c10::cuda::CUDAGuard device_guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor state = rng.contiguous();
  at::Tensor out = at::empty(grad.sizes(), grad.options());
  if (grad.numel() == 0) return out;
  const auto params = math::make_dropout_params(p);
  const bool vectorized = is_aligned16(grad.const_data_ptr()) && is_aligned16(out.const_data_ptr());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_add_position_backward_cuda", [&] {
        auto launch = [&](auto index_zero) {
          using index_t = decltype(index_zero);
          auto kernel = vectorized ? add_position_backward_kernel<scalar_t, index_t, true>
                                   : add_position_backward_kernel<scalar_t, index_t, false>;
          kernel<<<grid_for<scalar_t>(kernel, grad.numel()), kThreads, 0, stream>>>(
              grad.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
              static_cast<index_t>(grad.numel()), state.const_data_ptr<int64_t>(),
              params.threshold, params.scale);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (fits_int32(grad.numel())) launch(uint32_t{0});
        else launch(uint64_t{0});
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("add_position_forward", &add_position_forward_cuda);
  m.impl("add_position_backward", &add_position_backward_cuda);
}

}  // namespace ops
}  // namespace posenc
