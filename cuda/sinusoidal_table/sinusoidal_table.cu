// CUDA kernel of sinusoidal_table: one thread per entry, the shared double-precision
// formula at the host's frequencies, rounded once to the output dtype (a narrow one through
// float32, as on the CPU).
#include <algorithm>
#include <cmath>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "launch.h"
#include "posenc/math/sinusoid.h"

namespace posenc {
namespace ops {
namespace {

template <typename scalar_t>
__global__ void sinusoidal_table_kernel(const double* __restrict__ positions,
                                        const double* __restrict__ freq,
                                        scalar_t* __restrict__ out, int64_t numel,
                                        int64_t d_model) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const int64_t row = i / d_model;
    const int64_t col = i - row * d_model;
    const double v = math::sinusoid_value(positions[row], col, freq[col]);
    if constexpr (std::is_same_v<scalar_t, double>) {
      out[i] = v;
    } else {
      out[i] = static_cast<scalar_t>(static_cast<float>(v));
    }
  }
}

}  // namespace

cudaError_t launch_sinusoidal_table(const double* positions, const double* freq, void* out,
                                    c10::ScalarType dtype, int64_t numel, int64_t d_model,
                                    cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65535);
  const auto launch = [&](auto* typed) {
    sinusoidal_table_kernel<<<blocks, kThreads, 0, stream>>>(positions, freq, typed, numel, d_model);
  };
  switch (dtype) {
    case c10::ScalarType::Double: launch(static_cast<double*>(out)); break;
    case c10::ScalarType::Float: launch(static_cast<float*>(out)); break;
    case c10::ScalarType::BFloat16: launch(static_cast<c10::BFloat16*>(out)); break;
    case c10::ScalarType::Half: launch(static_cast<c10::Half*>(out)); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace ops
}  // namespace posenc
