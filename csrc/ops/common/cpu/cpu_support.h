// What every CPU backend file needs: output allocation.
#pragma once

#include <ATen/ATen.h>

namespace posenc {
namespace ops {

// An output that a kernel writes once, front to back: from torch's allocator, as every ATen
// op's outputs are (the profiler and memory accounting see it; allocation policy, such as
// preloading tcmalloc or jemalloc, is the allocator's).
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty(sizes, options);
}

// As empty_output, with the sizes and strides of `like` when it is dense (a transposed or
// channels-last tensor keeps its layout), contiguous otherwise.
inline at::Tensor empty_output_like(const at::Tensor& like) {
  return at::empty_like(like, at::MemoryFormat::Preserve);
}

}  // namespace ops
}  // namespace posenc
