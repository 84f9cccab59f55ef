// RMSNorm of q and k before RoPE (qk_norm_rope: Qwen3, Gemma 3, OLMo 2), the per-vector
// formulas shared by the CPU and the CUDA kernels.
//
// A normalised vector x of n features (one head: norm "head"; a token's whole projection:
// norm "hidden") with effective weights w (the weight plus weight_offset, Gemma's 1 + w):
//   r = 1 / sqrt(mean(x^2) + eps),   xhat = x * r,   y = xhat * w,   then RoPE of y.
// Backward, with gu the incoming gradient rotated back (RoPE is orthogonal up to its
// attention factor: the transpose rotation) and g = gu * w:
//   dx = r * (g - xhat * mean(g * xhat)),   dw = sum over vectors of gu * xhat.
// Everything in T = float32 (float64 for float64 inputs), as Hugging Face's RMSNorm modules.
#pragma once

#include <cmath>
#include <cstdint>

#include "posenc/math/host_device.h"

namespace posenc {
namespace math {
POSENC_ISA_NAMESPACE_BEGIN

// The norms a call may ask for, X(enumerator, "name").
#define POSENC_QK_NORMS(X) \
  X(kHead, "head")         \
  X(kHidden, "hidden")

// 1 / sqrt(sum_sq / n + eps): the inverse RMS of n features whose squares sum to sum_sq
// (1 / sqrt, not an approximate rsqrt, so that host and device agree).
template <typename T>
POSENC_HOST_DEVICE T qk_norm_inv_rms(T sum_sq, int64_t n, T eps) {
#if defined(__CUDA_ARCH__)
  return T(1) / sqrt(sum_sq / static_cast<T>(n) + eps);  // CUDA's overloads: sqrtf for float
#else
  return T(1) / std::sqrt(sum_sq / static_cast<T>(n) + eps);
#endif
}

// The normalised, weighted feature: (x * r) * w.
template <typename T>
POSENC_HOST_DEVICE T qk_norm_apply(T x, T r, T w) {
  return (x * r) * w;
}

// The gradient of x from the unrotated incoming gradient gu of its feature: g = gu * w,
// dx = r * (g - xhat * mean_gx), where mean_gx = mean over the vector of g * xhat.
template <typename T>
POSENC_HOST_DEVICE T qk_norm_grad_input(T gu, T w, T xhat, T mean_gx, T r) {
  return r * (gu * w - xhat * mean_gx);
}

POSENC_ISA_NAMESPACE_END
}  // namespace math
}  // namespace posenc
