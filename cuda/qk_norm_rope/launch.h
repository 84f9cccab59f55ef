// The qk_norm_rope family's CUDA launchers (qk_norm_rope.cu), called by qk_norm_rope.cpp's
// CUDA registration: plain kernel arguments in, the launch's cudaError_t out
// (cuda/common/occupancy.cuh), on the current device, for float, double, c10::Half and
// c10::BFloat16.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/qk_norm_rope/cpu/kernel.h"  // QkNormRopeArgs

namespace posenc {
namespace ops {

// qk_norm_rope and qk_norm_rope_, q and k of type scalar_t, on `stream`.
template <typename scalar_t>
cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream);

// The backward in two steps, so that its scratch memory comes from the caller's allocator:
// qk_norm_rope_backward_rows gives the number of partial-sum rows its fixed grid writes (one
// per warp: no atomics) for weights of lq + lk > 0 values; the caller allocates `rows`
// (n_rows x row_len zeros, row_len = 2 * max(lq, lk): q's terms at [0, lq), k's at
// [row_len / 2, ...)) and `sums` (row_len), in the compute dtype (float32; float64 for
// float64), and launch_qk_norm_rope_backward writes dx and sums the rows, in order, into sums.
template <typename scalar_t>
cudaError_t qk_norm_rope_backward_rows(const QkNormRopeArgs& a, int64_t lq, int64_t lk, int64_t* n_rows);
template <typename scalar_t>
cudaError_t launch_qk_norm_rope_backward(const QkNormRopeArgs& a, void* rows, int64_t n_rows, int64_t row_len,
                                         void* sums, cudaStream_t stream);

}  // namespace ops
}  // namespace posenc
