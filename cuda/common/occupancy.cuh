// What every CUDA family's launchers share, free of ATen's tensor and dispatcher headers as
// the kernels are (the .cu files include the CUDA runtime, c10's Half and BFloat16, ATen's
// light IntegerDivider.cuh and PhiloxUtils.cuh, and posenc's plain headers, so each compiles
// in seconds; the family's <family>.cpp holds the ATen side: outputs, device guard, stream,
// dtype switch, errors): one wave of resident blocks from the occupancy calculator,
// the accumulation type of a dtype, the explicit instantiations of a launcher for the
// floating dtypes, and the launchers' error convention (a cudaError_t, which the caller
// raises with C10_CUDA_CHECK).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

// Returns the error of a CUDA runtime call from the enclosing launcher.
#define POSENC_CUDA_TRY(expr)                          \
  do {                                                 \
    const cudaError_t posenc_error_ = (expr);          \
    if (posenc_error_ != cudaSuccess) return posenc_error_; \
  } while (0)

// The explicit instantiations of launcher template `name` (signature `sig`, with scalar_t
// the dtype) for the dtypes the ops take, the set of AT_DISPATCH_FLOATING_TYPES_AND2(Half,
// BFloat16) with which each <family>.cpp calls them.
#define POSENC_CUDA_INSTANTIATE_FLOATING(name, ...)                   \
  template cudaError_t name<float>(__VA_ARGS__);                      \
  template cudaError_t name<double>(__VA_ARGS__);                     \
  template cudaError_t name<c10::Half>(__VA_ARGS__);                  \
  template cudaError_t name<c10::BFloat16>(__VA_ARGS__);

namespace posenc {
namespace cuda {

// at::opmath_type without ATen: float for the 16-bit dtypes, the dtype itself otherwise.
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<c10::Half> {
  using type = float;
};
template <>
struct OpMath<c10::BFloat16> {
  using type = float;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// Blocks of `kernel` (no dynamic shared memory) that fit on the current device at once at
// `threads` threads per block: resident blocks per SM times the SM count, at least one per
// SM. cudaOccupancyMaxActiveBlocksPerMultiprocessor is a host-side query (no device
// synchronisation) but takes microseconds, which every launch of a small tensor would pay;
// its answer depends only on the kernel, the block size and the device, so it is asked once.
inline cudaError_t resident_blocks(const void* kernel, int threads, int64_t* blocks) {
  int device = 0;
  POSENC_CUDA_TRY(cudaGetDevice(&device));
  using Key = std::tuple<const void*, int, int>;
  static std::mutex mutex;
  static std::map<Key, int64_t> cache;
  const Key key{kernel, threads, device};
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto found = cache.find(key);
    if (found != cache.end()) {
      *blocks = found->second;
      return cudaSuccess;
    }
  }
  int per_sm = 0, sms = 0;
  POSENC_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  POSENC_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  *blocks = static_cast<int64_t>(sms) * std::max(per_sm, 1);
  std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, *blocks);
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace posenc
