// The rope_shift_kv family's CUDA launcher (rope_shift_kv.cu), called by rope_shift_kv.cpp's
// CUDA registration: plain kernel arguments in, the launch's cudaError_t out
// (cuda/common/occupancy.cuh), on the current device, for float, double, c10::Half and
// c10::BFloat16.
#pragma once

#include <cuda_runtime_api.h>

#include "ops/rope_shift_kv/cpu/kernel.h"  // RopeShiftKvArgs

namespace posenc {
namespace ops {

// rope_shift_kv_ of a cache of scalar_t elements, or of an FP8 cache (a.format) with
// scalar_t float, the dtype its values are rotated in; on `stream`.
template <typename scalar_t>
cudaError_t launch_rope_shift_kv(const RopeShiftKvArgs& a, cudaStream_t stream);

}  // namespace ops
}  // namespace posenc
