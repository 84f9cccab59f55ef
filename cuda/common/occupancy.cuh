// One wave of resident blocks for the grid-stride kernels, from the occupancy calculator,
// cached per (kernel, block size, device).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace posenc {
namespace cuda {

// Blocks of `kernel` (no dynamic shared memory) that fit on the current device at once at
// `threads` threads per block: resident blocks per SM times the SM count, at least one per
// SM. cudaOccupancyMaxActiveBlocksPerMultiprocessor is a host-side query (no device
// synchronisation) but takes microseconds, which every launch of a small tensor would pay;
// its answer depends only on the kernel, the block size and the device, so it is asked once.
inline int64_t resident_blocks(const void* kernel, int threads) {
  using Key = std::tuple<const void*, int, c10::DeviceIndex>;
  static std::mutex mutex;
  static std::map<Key, int64_t> cache;
  const Key key{kernel, threads, c10::cuda::current_device()};
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto found = cache.find(key);
    if (found != cache.end()) return found->second;
  }
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int64_t blocks =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) *
      std::max(per_sm, 1);
  std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, blocks);
  return blocks;
}

}  // namespace cuda
}  // namespace posenc
