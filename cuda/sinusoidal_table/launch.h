// The sinusoidal_table family's CUDA launcher (sinusoidal_table.cu), called by
// sinusoidal_table.cpp's CUDA registration: plain arguments in, the launch's cudaError_t out
// (cuda/common/occupancy.cuh), on the current device.
#pragma once

#include <c10/core/ScalarType.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace posenc {
namespace ops {

// out[i, j] (numel = rows * d_model values of dtype: float64, float32, bfloat16 or float16)
// = the encoding of positions[i] (float64) at column j of frequency freq[j] (d_model float64
// values on the device, the host's: sinusoid_frequencies), on `stream`.
cudaError_t launch_sinusoidal_table(const double* positions, const double* freq, void* out,
                                    c10::ScalarType dtype, int64_t numel, int64_t d_model,
                                    cudaStream_t stream);

}  // namespace ops
}  // namespace posenc
