// The rope family's CUDA launchers (rope.cu), called by rope.cpp's CUDA registration: plain
// kernel arguments in, the launch's cudaError_t out (cuda/common/occupancy.cuh), on the
// current device, for float, double, c10::Half and c10::BFloat16.
#pragma once

#include <cuda_runtime_api.h>

#include "ops/common/rope_args.h"

namespace posenc {
namespace ops {

// rope and rope_ (the backward too: a.inverse), elements of type scalar_t, on `stream`.
template <typename scalar_t>
cudaError_t launch_rope(const RopeArgs& a, cudaStream_t stream);

}  // namespace ops
}  // namespace posenc
