// CUDA kernel of sinusoidal_table: one thread per entry, the shared double-precision
// formula, rounded once to the output dtype.
#include <algorithm>
#include <cmath>

#include "launch.h"
#include "posenc/math/sinusoid.h"

namespace posenc {
namespace ops {
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

}  // namespace

cudaError_t launch_sinusoidal_table(const double* positions, double* out, int64_t numel,
                                    int64_t d_model, double log_base, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65535);
  sinusoidal_table_kernel<double><<<blocks, kThreads, 0, stream>>>(positions, out, numel, d_model, log_base);
  return cudaGetLastError();
}

}  // namespace ops
}  // namespace posenc
