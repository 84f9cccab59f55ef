// CUDA kernel of sinusoidal_table: one thread per entry, the shared double-precision
// formula, rounded once to the output dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "posenc/math/sinusoid.h"

namespace posenc {
namespace ops {

// The op's argument checks, shared by every backend: defined in
// csrc/ops/sinusoidal_table/sinusoidal_table.cpp (the family has no header of its own).
void check_sinusoidal_table_args(const at::Tensor& positions, int64_t d_model, double base);

namespace {

template <typename scalar_t>
__global__ void sinusoidal_table_kernel(const double* __restrict__ positions,
                                        scalar_t* __restrict__ out, int64_t numel,
                                        int64_t d_model, double log_base) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const int64_t row = i / d_model;
    const int64_t col = i - row * d_model;
    out[i] = static_cast<scalar_t>(math::sinusoid_value(positions[row], col, d_model, log_base));
  }
}

at::Tensor sinusoidal_table_cuda(const at::Tensor& positions, int64_t d_model, double base) {
  check_sinusoidal_table_args(positions, d_model, base);
  const c10::cuda::CUDAGuard device_guard(positions.device());
  const at::Tensor pos = positions.to(at::kDouble).contiguous();
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(d_model);
  at::Tensor out = at::empty(shape, positions.options().dtype(at::kDouble));
  const int64_t numel = out.numel();
  if (numel == 0) return out;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65535);
  sinusoidal_table_kernel<double><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      pos.const_data_ptr<double>(), out.mutable_data_ptr<double>(), numel, d_model,
      std::log(base));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_cuda);
}

}  // namespace ops
}  // namespace posenc
