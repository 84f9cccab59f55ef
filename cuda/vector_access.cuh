// 16-byte vector loads and stores of 8-element groups (one dropout block), used when the
// pointers allow it; callers fall back to element loads otherwise.
#pragma once

#include <cstdint>

namespace posenc {
namespace cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
constexpr int kPerVector = 16 / sizeof(T);  // 8 half/bfloat16, 4 float, 2 double

// Loads group[0..7] from p, converting to acc_t. p must be 16-byte aligned.
template <typename T, typename acc_t>
__device__ __forceinline__ void load_group(const T* __restrict__ p, acc_t (&group)[8]) {
  constexpr int kN = kPerVector<T>;
#pragma unroll
  for (int k = 0; k < 8; k += kN) {
    const Pack<T, kN> pack = *reinterpret_cast<const Pack<T, kN>*>(p + k);
#pragma unroll
    for (int i = 0; i < kN; ++i) group[k + i] = static_cast<acc_t>(pack.v[i]);
  }
}

template <typename T, typename acc_t>
__device__ __forceinline__ void store_group(T* __restrict__ p, const acc_t (&group)[8]) {
  constexpr int kN = kPerVector<T>;
#pragma unroll
  for (int k = 0; k < 8; k += kN) {
    Pack<T, kN> pack;
#pragma unroll
    for (int i = 0; i < kN; ++i) pack.v[i] = static_cast<T>(group[k + i]);
    *reinterpret_cast<Pack<T, kN>*>(p + k) = pack;
  }
}

inline bool is_aligned16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

}  // namespace cuda
}  // namespace posenc
