// Marks a function as callable from both host and device code, so the CPU kernels
// and the CUDA kernels compile the very same math.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define POSENC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define POSENC_HOST_DEVICE inline
#endif
