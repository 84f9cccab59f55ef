// 16-byte vector loads and stores of 8-element groups (one dropout block), used when the
// pointers allow it; callers fall back to element loads otherwise.
//
// Every 16-byte store goes through store_pack, which writes four 32-bit words with one
// st.global.v4.b32. Assigning a Pack<T, N> struct, or even a uint4, is not enough: nvcc's
// front end may turn the copy into narrower stores (the interleaved RoPE store and the
// half-precision grad_x store of the table backward came out as 2- and 4-byte stores, the
// latter even through a uint4), depending on the code around it. Loads are plain uint4
// reads (always one LDG.E.128 so far). tests/cpp/check_cuda_kernels.py checks the SASS.
#pragma once

#include <cstdint>
#include <cstring>

namespace posenc {
namespace cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
constexpr int kPerVector = 16 / sizeof(T);  // 8 half/bfloat16, 4 float, 2 double

// One 16-byte load / store; p must be 16-byte aligned.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  static_assert(sizeof(T) * N == 16, "a pack is 16 bytes");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  Pack<T, N> out;
  memcpy(&out, &raw, 16);
  return out;
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  static_assert(sizeof(T) * N == 16, "a pack is 16 bytes");
  uint4 w;
  memcpy(&w, &v, 16);
  // "memory": the compiler must not move other accesses to this memory across the store.
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y),
               "r"(w.z), "r"(w.w)
               : "memory");
}

// Stores group[0..7] to p, converted to T. p must be 16-byte aligned.
template <typename T, typename acc_t>
__device__ __forceinline__ void store_group(T* __restrict__ p, const acc_t (&group)[8]) {
  constexpr int kN = kPerVector<T>;
#pragma unroll
  for (int k = 0; k < 8; k += kN) {
    Pack<T, kN> pack;
#pragma unroll
    for (int i = 0; i < kN; ++i) pack.v[i] = static_cast<T>(group[k + i]);
    store_pack<T, kN>(p + k, pack);
  }
}

// A group of 8 elements as loaded (one or more 16-byte packs), converted later: kernels
// issue the loads of several groups first and convert when they use them, which keeps
// half the registers of the float32 values for 16-bit types while the loads are in flight.
template <typename T>
struct RawGroup {
  static constexpr int kN = kPerVector<T>;
  uint4 word[8 / kN];  // 32-bit words: 16-bit elements stay packed two to a register
};

template <typename T>
__device__ __forceinline__ RawGroup<T> load_raw_group(const T* __restrict__ p) {
  RawGroup<T> r;
#pragma unroll
  for (int k = 0; k < 8 / RawGroup<T>::kN; ++k) {
    r.word[k] = *reinterpret_cast<const uint4*>(p + k * RawGroup<T>::kN);
  }
  return r;
}

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> unpack_words(const uint4& w) {
  static_assert(sizeof(T) * N == 16, "a pack is 16 bytes");
  Pack<T, N> out;
  memcpy(&out, &w, 16);
  return out;
}

template <typename T, typename acc_t>
__device__ __forceinline__ void convert_group(const RawGroup<T>& r, acc_t (&group)[8]) {
  constexpr int kN = RawGroup<T>::kN;
#pragma unroll
  for (int k = 0; k < 8 / kN; ++k) {
    const Pack<T, kN> pack = unpack_words<T, kN>(r.word[k]);
#pragma unroll
    for (int i = 0; i < kN; ++i) group[k * kN + i] = static_cast<acc_t>(pack.v[i]);
  }
}

inline bool is_aligned16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

}  // namespace cuda
}  // namespace posenc
