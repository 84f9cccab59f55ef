// Device helpers shared by the RoPE kernels (cuda/rope_cuda.cu, cuda/rope_cos_sin_cuda.cu):
// P rotary pairs of a row loaded, unpacked, stored (16-byte accesses on the fast path,
// elements with any stride otherwise), the row of a head of q or k, and the partial-rotary
// pass-through copy.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>
#include <limits>

#include "ops/rope/rope_args.h"
#include "posenc/math/rope.h"
#include "vector_access.cuh"

namespace posenc {
namespace ops {
namespace rope_cuda {

using cuda::Pack;

// P pairs of a row as loaded, before conversion: two 16-byte words on the fast path (the
// halves of rotate_half, or two consecutive packs of interleaved pairs), the elements e1
// and e2 of the pair otherwise (P = 1). Kept in this form while the sin/cos are evaluated:
// 16-bit elements stay two to a register (as 8 separate halves they spilled).
template <typename scalar_t, int P, bool kVec>
struct RawPairs {
  uint4 a, b;
};
template <typename scalar_t, int P>
struct RawPairs<scalar_t, P, false> {
  scalar_t a, b;
};

template <typename scalar_t, int P, bool kVec>
__device__ __forceinline__ RawPairs<scalar_t, P, kVec> load_pairs(const scalar_t* row,
                                                                  int64_t sd, int64_t half,
                                                                  bool interleaved, int64_t p0) {
  RawPairs<scalar_t, P, kVec> r;
  if constexpr (kVec) {
    const int64_t first = interleaved ? 2 * p0 : p0;
    const int64_t second = interleaved ? 2 * p0 + P : half + p0;
    r.a = *reinterpret_cast<const uint4*>(row + first);
    r.b = *reinterpret_cast<const uint4*>(row + second);
  } else {
    static_assert(P == 1, "the element path handles one pair");
    int64_t e1, e2;
    math::rope_pair_features(p0, half, interleaved, &e1, &e2);
    r.a = row[e1 * sd];
    r.b = row[e2 * sd];
  }
  return r;
}

// The pairs (x1[k], x2[k]) of loaded data.
template <typename scalar_t, typename acc_t, int P, bool kVec>
__device__ __forceinline__ void unpack_pairs(const RawPairs<scalar_t, P, kVec>& r,
                                             bool interleaved, acc_t (&x1)[P], acc_t (&x2)[P]) {
  if constexpr (kVec) {
    const Pack<scalar_t, P> a = cuda::unpack_words<scalar_t, P>(r.a);
    const Pack<scalar_t, P> b = cuda::unpack_words<scalar_t, P>(r.b);
    if (interleaved) {
#pragma unroll
      for (int k = 0; k < P; ++k) {
        x1[k] = static_cast<acc_t>(k < P / 2 ? a.v[2 * k] : b.v[2 * k - P]);
        x2[k] = static_cast<acc_t>(k < P / 2 ? a.v[2 * k + 1] : b.v[2 * k + 1 - P]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < P; ++k) {
        x1[k] = static_cast<acc_t>(a.v[k]);
        x2[k] = static_cast<acc_t>(b.v[k]);
      }
    }
  } else {
    x1[0] = static_cast<acc_t>(r.a);
    x2[0] = static_cast<acc_t>(r.b);
  }
}

// Stores P rotated pairs; on the 16-byte path two 16-byte stores (store_pack: one
// STG.E.128 each, in both layouts).
template <typename scalar_t, typename acc_t, int P, bool kVec>
__device__ __forceinline__ void store_pairs(scalar_t* row, int64_t sd, int64_t half,
                                            bool interleaved, int64_t p0, const acc_t (&y1)[P],
                                            const acc_t (&y2)[P]) {
  if constexpr (kVec) {
    Pack<scalar_t, P> a, b;
    if (!interleaved) {
#pragma unroll
      for (int k = 0; k < P; ++k) {
        a.v[k] = static_cast<scalar_t>(y1[k]);
        b.v[k] = static_cast<scalar_t>(y2[k]);
      }
      cuda::store_pack<scalar_t, P>(row + p0, a);
      cuda::store_pack<scalar_t, P>(row + half + p0, b);
    } else {
#pragma unroll
      for (int k = 0; k < P / 2; ++k) {
        a.v[2 * k] = static_cast<scalar_t>(y1[k]);
        a.v[2 * k + 1] = static_cast<scalar_t>(y2[k]);
        b.v[2 * k] = static_cast<scalar_t>(y1[k + P / 2]);
        b.v[2 * k + 1] = static_cast<scalar_t>(y2[k + P / 2]);
      }
      cuda::store_pack<scalar_t, P>(row + 2 * p0, a);
      cuda::store_pack<scalar_t, P>(row + 2 * p0 + P, b);
    }
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      int64_t e1, e2;
      math::rope_pair_features(p0 + k, half, interleaved, &e1, &e2);
      row[e1 * sd] = static_cast<scalar_t>(y1[k]);
      row[e2 * sd] = static_cast<scalar_t>(y2[k]);
    }
  }
}

// Row h of the (q heads, then k heads) of token (b, s): input and output pointers.
// Args: anything with the RopeOperands q and k (RopeArgs, RopeCosSinArgs).
template <typename scalar_t, typename Args>
__device__ __forceinline__ void head_rows(const Args& a, int64_t b, int64_t s, int64_t h,
                                          const scalar_t** in, scalar_t** out, int64_t* in_sd,
                                          int64_t* out_sd) {
  const bool is_q = h < a.q.heads;
  const RopeOperand& op = is_q ? a.q : a.k;
  const int64_t hh = is_q ? h : h - a.q.heads;
  *in = static_cast<const scalar_t*>(op.in) + b * op.in_stride[0] + s * op.in_stride[1] +
        hh * op.in_stride[2];
  *out = static_cast<scalar_t*>(op.out) + b * op.out_stride[0] + s * op.out_stride[1] +
         hh * op.out_stride[2];
  *in_sd = op.in_stride[3];
  *out_sd = op.out_stride[3];
}

// Copies features rotary_dim + j, j = p0, p0 + step, ... < pass, of one row, P at a time
// (NaN instead when the token is invalid). On the 16-byte path rotary_dim is a multiple of
// 2P and the rows are 16-byte aligned, so each whole chunk is one 16-byte load and store.
template <typename scalar_t, int P, bool kVec>
__device__ __forceinline__ void copy_pass_through(const scalar_t* in, scalar_t* out,
                                                  int64_t in_sd, int64_t out_sd,
                                                  int64_t rotary_dim, int64_t pass, int64_t p0,
                                                  int64_t step, bool valid) {
  const scalar_t nan = static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN());
  for (int64_t j = p0; j < pass; j += step) {
    const int64_t e = rotary_dim + j;
    if constexpr (kVec) {
      if (j + P <= pass) {
        Pack<scalar_t, P> v = cuda::load_pack<scalar_t, P>(in + e);
        if (!valid) {
#pragma unroll
          for (int k = 0; k < P; ++k) v.v[k] = nan;
        }
        cuda::store_pack<scalar_t, P>(out + e, v);
        continue;
      }
    }
    for (int64_t k = 0; k < P && j + k < pass; ++k) {
      out[(e + k) * out_sd] = valid ? in[(e + k) * in_sd] : nan;
    }
  }
}

}  // namespace rope_cuda
}  // namespace ops
}  // namespace posenc
