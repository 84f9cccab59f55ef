// What every CPU backend file needs: output allocation, and when an output is large enough to
// be written by streaming stores.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace posenc {
namespace ops {

// Streaming stores (RoPE's rows, rope_append_kv's, the tables, add_position's forward) pay off
// once the rows written are well beyond what the caches keep: the data would be evicted before
// anyone reads it, and a plain store first reads every line it overwrites. A prefill of 2048
// tokens (48 MiB written in float32) streams; a decode step (a few hundred KiB, read back at
// once by attention) does not: its rows are best left in the caches for the reader. The one
// threshold of every kernel that streams (the vector-ISA kernels and sinusoidal_2d_table).
constexpr int64_t kStreamBytes = int64_t{8} << 20;

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
