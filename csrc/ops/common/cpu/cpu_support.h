// What every CPU backend file needs: output allocation.
#pragma once

#include <ATen/ATen.h>

namespace posenc {
namespace ops {

// An output that a kernel writes once, front to back. Large ones (>= 32 MiB) reuse the
// blocks of freed outputs (POSENC_CPU_OUTPUTS=reuse, the default): a fresh 32 MiB output
// otherwise costs ~8000 page faults, which take longer than the kernel itself
// (benchmarks/NOTES.md, "CPU output memory"). POSENC_CPU_OUTPUTS=fresh gives torch's
// allocator, =huge the former huge-page advice.
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options);

// As empty_output, with the sizes and strides of `like` when it is dense (a transposed or
// channels-last tensor keeps its layout), contiguous otherwise.
at::Tensor empty_output_like(const at::Tensor& like);

// Unmaps the free blocks the output cache holds (op posenc::empty_cpu_output_cache); returns
// their bytes. 0 when the cache is off (POSENC_CPU_OUTPUTS=fresh or huge) or empty.
int64_t empty_cpu_output_cache();

}  // namespace ops
}  // namespace posenc
