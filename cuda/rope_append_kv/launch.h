// The rope_append_kv family's CUDA launcher (rope_append_kv.cu), called by rope_append_kv.cpp's
// CUDA registration: plain kernel arguments in, the launch's cudaError_t out
// (cuda/common/occupancy.cuh), on the current device, for float, double, c10::Half and
// c10::BFloat16.
#pragma once

#include <cuda_runtime_api.h>

#include "ops/rope_append_kv/cpu/kernel.h"  // KvCacheArgs

namespace posenc {
namespace ops {

// rope_append_kv and rope_append_kv_ (QK-norm when a.q_weight is set), q, k and v of type
// scalar_t, on `stream`.
template <typename scalar_t>
cudaError_t launch_rope_append_kv(const KvCacheArgs& a, cudaStream_t stream);

}  // namespace ops
}  // namespace posenc
