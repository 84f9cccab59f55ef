// The sum over a warp, as the QK-norm kernels (qk_norm_rope's, rope_append_kv's) reduce each
// vector's sum of squares: one butterfly, so both kernels add in the same order and give the
// same bits.
#pragma once

namespace posenc {
namespace ops {
namespace rope_cuda {

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace rope_cuda
}  // namespace ops
}  // namespace posenc
