// The RoPE family's index value checks on the device (the CPU's are check_cpu_index_values,
// rope_launch.cpp), shared by the kernels that take RoPE's positions (rope, qk_norm_rope), so
// that a default call reads no value on the host (no sync: CUDA graphs can capture it). A
// failure stops the kernel with a device-side assert, as ATen's indexing does: a RuntimeError
// at the next synchronisation, after which the CUDA context is unusable.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

#include "ops/common/rope_args.h"  // RopeArgs, kRopeMaxPosition

namespace posenc {
namespace ops {
namespace rope_cuda {

__device__ __forceinline__ bool rope_in_position_domain(int64_t v) {
  return v >= -kRopeMaxPosition && v <= kRopeMaxPosition;
}

// cu_seqlens starts at 0, never decreases and ends at the token count: block 0 reads it once.
__device__ __forceinline__ void assert_cu_seqlens(const RopeArgs& a) {
  if (blockIdx.x != 0 || (a.cu_seqlens == nullptr && a.cu_seqlens32 == nullptr)) return;
  const auto cu = [&](int64_t j) -> int64_t {
    return a.cu_seqlens != nullptr ? a.cu_seqlens[j] : a.cu_seqlens32[j];
  };
  for (int64_t j = threadIdx.x; j <= a.num_seqs; j += blockDim.x) {
    const int64_t v = cu(j);
    CUDA_KERNEL_ASSERT_MSG((j == 0 ? v == 0 : cu(j - 1) <= v) && (j < a.num_seqs || v == a.seq),
                           "posenc: rope: expected cu_seqlens to start at 0, never decrease and "
                           "end at the number of tokens");
  }
}

// A token's start: inside a sequence of cu_seqlens (valid), its offsets value (shift minus
// the int offset) in the domain.
__device__ __forceinline__ void assert_token_start(const RopeArgs& a, bool valid, int64_t shift) {
  CUDA_KERNEL_ASSERT_MSG(valid, "posenc: rope: a packed token lies outside every sequence of "
                         "cu_seqlens");
  CUDA_KERNEL_ASSERT_MSG(rope_in_position_domain(shift - a.offset),
                         "posenc: rope: expected offsets within " POSENC_ROPE_POSITION_RANGE);
}

}  // namespace rope_cuda
}  // namespace ops
}  // namespace posenc
