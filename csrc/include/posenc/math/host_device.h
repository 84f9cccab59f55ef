// Marks a function as callable from both host and device code, so the CPU kernels
// and the CUDA kernels compile the very same math.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define POSENC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define POSENC_HOST_DEVICE inline
#endif

// The ISA namespace (ATen's CPU_CAPABILITY pattern). The CPU kernels built for AVX2 define
// CPU_CAPABILITY=AVX2; every other translation unit leaves the token undefined, so there it
// names a namespace of its own. The inline functions of the shared headers live in it, so
// an AVX2 copy and a plain copy are different symbols and the linker can never keep one for
// the other, whatever the order of the sources. Types stay outside: they are the same in
// every translation unit and cross between them (tests/cpp/check_isa_symbols.sh checks).
#define POSENC_ISA_NAMESPACE_BEGIN inline namespace CPU_CAPABILITY {
#define POSENC_ISA_NAMESPACE_END }
