// The rope_cos_sin family's CUDA launcher (rope_cos_sin.cu), called by rope_cos_sin.cpp's CUDA
// registration: plain kernel arguments in, the launch's cudaError_t out
// (cuda/common/occupancy.cuh), on the current device, for float, double, c10::Half and
// c10::BFloat16.
#pragma once

#include <cuda_runtime_api.h>

#include "ops/rope_cos_sin/cpu/kernel.h"  // RopeCosSinArgs

namespace posenc {
namespace ops {

// apply_rope_cos_sin (the backward too: a.transpose), elements of type scalar_t, on `stream`.
template <typename scalar_t>
cudaError_t launch_rope_cos_sin(const RopeCosSinArgs& a, cudaStream_t stream);

}  // namespace ops
}  // namespace posenc
