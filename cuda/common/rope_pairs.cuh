// What the RoPE kernels (cuda/rope/rope.cu, cuda/rope_cos_sin/rope_cos_sin.cu) share: on the
// device, P rotary pairs of a row loaded, unpacked, stored (16-byte accesses on the fast
// path, elements with any stride otherwise), the row of a head of q or k, the
// partial-rotary pass-through copy; on the host, the fast-path test and the launch with
// the work split of ops/common/cuda_work_split.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "ops/common/cuda_work_split.h"
#include "ops/common/rope_args.h"
#include "posenc/math/rope.h"
#include "occupancy.cuh"
#include "vector_access.cuh"

namespace posenc {
namespace ops {
namespace rope_cuda {

using cuda::Pack;

constexpr int kRopeThreads = 256;   // threads a block at most
constexpr int kRopeMaxSlots = 32;   // tokens a block at most

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

// Where the rotary features of a head start (math::rope_rotary_begin): Args with plain
// settings (RopeArgs) say so, others (RopeCosSinArgs) rotate from feature 0.
template <typename Args, typename = void>
struct HasRopeSettings : std::false_type {};
template <typename Args>
struct HasRopeSettings<Args, std::void_t<decltype(std::declval<Args>().settings)>> : std::true_type {};

template <typename Args>
__host__ __device__ __forceinline__ int64_t rotary_begin(const Args& a) {
  if constexpr (HasRopeSettings<Args>::value) {
    return math::rope_rotary_begin(a.settings);
  } else {
    return 0;
  }
}

// Copies pass-through features math::rope_pass_feature(j), j = p0, p0 + step, ... < pass
// (the features before the rotary part, then those after it), of one row, P at a time
// (NaN instead when the token is invalid). On the 16-byte path rotary_dim is a multiple of
// 2P, the rotary part starts at a multiple of P and the rows are 16-byte aligned, so each
// whole chunk lies on one side of the rotary part and is one 16-byte load and store.
template <typename scalar_t, int P, bool kVec>
__device__ __forceinline__ void copy_pass_through(const scalar_t* in, scalar_t* out,
                                                  int64_t in_sd, int64_t out_sd, int64_t begin,
                                                  int64_t rotary_dim, int64_t pass, int64_t p0,
                                                  int64_t step, bool valid) {
  const scalar_t nan = static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN());
  for (int64_t j = p0; j < pass; j += step) {
    const int64_t e = math::rope_pass_feature(j, begin, rotary_dim);
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
      const int64_t f = math::rope_pass_feature(j + k, begin, rotary_dim);
      out[f * out_sd] = valid ? in[f * in_sd] : nan;
    }
  }
}

// Pairs p0 .. p0 + P - 1 of head `lane` of token (b, s), loaded before the step's barrier.
template <typename scalar_t, int P, bool kVec, typename Args>
__device__ __forceinline__ RawPairs<scalar_t, P, kVec> load_first_head(const Args& a, int64_t b,
                                                                       int64_t s, int64_t lane,
                                                                       int64_t p0) {
  const scalar_t* in;
  scalar_t* out;
  int64_t in_sd, out_sd;
  head_rows<scalar_t>(a, b, s, lane, &in, &out, &in_sd, &out_sd);
  return load_pairs<scalar_t, P, kVec>(in + rotary_begin(a) * in_sd, in_sd, a.rotary_dim / 2,
                                       a.interleaved, p0);
}

// Rotates pairs p0 .. p0 + P - 1 of heads lane, lane + head_lanes, ... of token (b, s):
// `raw` holds the first head's pairs (load_first_head); each next head's are loaded right
// after the previous head's store. rotate(k, x1, x2, &y1, &y2) rotates pair p0 + k.
template <typename scalar_t, typename acc_t, int P, bool kVec, typename Args, typename Rotate>
__device__ __forceinline__ void rotate_heads(const Args& a, int64_t b, int64_t s, int64_t lane,
                                             int64_t head_lanes, int64_t p0,
                                             RawPairs<scalar_t, P, kVec> raw, Rotate rotate) {
  const int64_t half = a.rotary_dim / 2;
  const int64_t heads = a.q.heads + a.k.heads;
  const int64_t begin = rotary_begin(a);
  for (int64_t h = lane;;) {
    const scalar_t* in;
    scalar_t* out;
    int64_t in_sd, out_sd;
    head_rows<scalar_t>(a, b, s, h, &in, &out, &in_sd, &out_sd);
    acc_t x1[P], x2[P], y1[P], y2[P];
    unpack_pairs<scalar_t, acc_t, P, kVec>(raw, a.interleaved, x1, x2);
#pragma unroll
    for (int k = 0; k < P; ++k) rotate(k, x1[k], x2[k], &y1[k], &y2[k]);
    store_pairs<scalar_t, acc_t, P, kVec>(out + begin * out_sd, out_sd, half, a.interleaved, p0,
                                          y1, y2);
    h += head_lanes;
    if (h >= heads) break;
    head_rows<scalar_t>(a, b, s, h, &in, &out, &in_sd, &out_sd);
    raw = load_pairs<scalar_t, P, kVec>(in + begin * in_sd, in_sd, half, a.interleaved, p0);
  }
}

// The pass-through features of heads lane, lane + head_lanes, ... of token (b, s), chunk
// p0 / P of every chunks * P (copy_pass_through).
template <typename scalar_t, int P, bool kVec, typename Args>
__device__ __forceinline__ void pass_through_heads(const Args& a, int64_t b, int64_t s,
                                                   int64_t lane, int64_t head_lanes, int chunks,
                                                   int64_t p0, bool valid) {
  const int64_t heads = a.q.heads + a.k.heads;
  for (int64_t h = lane; h < heads; h += head_lanes) {
    const scalar_t* in;
    scalar_t* out;
    int64_t in_sd, out_sd;
    head_rows<scalar_t>(a, b, s, h, &in, &out, &in_sd, &out_sd);
    copy_pass_through<scalar_t, P, kVec>(in, out, in_sd, out_sd, rotary_begin(a), a.rotary_dim,
                                         a.head_dim - a.rotary_dim, p0,
                                         static_cast<int64_t>(chunks) * P, valid);
  }
}

// The 16-byte path needs every row of q and k (in and out) contiguous and 16-byte aligned,
// and whole chunks of P pairs. Args: RopeArgs or RopeCosSinArgs.
template <typename Args>
bool rope_can_vectorize(const Args& a, int64_t P) {
  if ((a.rotary_dim / 2) % P != 0 || rotary_begin(a) % P != 0) return false;
  for (const RopeOperand* op : {&a.q, &a.k}) {
    if (op->heads == 0) continue;
    if (op->in_stride[3] != 1 || op->out_stride[3] != 1) return false;
    if (!cuda::is_aligned16(op->in) || !cuda::is_aligned16(op->out)) return false;
    for (int d = 0; d < 3; ++d) {
      if (op->in_stride[d] % P != 0 || op->out_stride[d] % P != 0) return false;
    }
  }
  return true;
}

// Launches kernel(a, shape) on `stream`: the block shape of the call (rope_block_shape:
// kRopeThreads, kMaxRopePairs shared pairs, kRopeMaxSlots) and one wave of resident blocks
// (cuda::resident_blocks), the kernel walking the tokens grid-stride. A rotary_dim that
// passed the op checks always fits the block (cudaErrorInvalidConfiguration otherwise).
template <typename Args>
cudaError_t launch_rope_kernel(void (*kernel)(Args, RopeBlockShape), const Args& a, int P,
                               cudaStream_t stream) {
  const int64_t tokens = a.batch * a.seq;
  const RopeBlockShape shape = rope_block_shape(a.rotary_dim / 2, a.q.heads + a.k.heads, tokens,
                                                P, kRopeThreads, kMaxRopePairs, kRopeMaxSlots);
  if (!rope_block_shape_fits(shape, a.rotary_dim / 2, kRopeThreads, kMaxRopePairs)) {
    return cudaErrorInvalidConfiguration;
  }
  const int threads = shape.threads();
  const int64_t steps = (tokens + shape.slots - 1) / shape.slots;
  int64_t wave = 0;
  POSENC_CUDA_TRY(::posenc::cuda::resident_blocks(reinterpret_cast<const void*>(kernel), threads, &wave));
  const int64_t blocks = std::min<int64_t>(steps, wave);
  kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(a, shape);
  return cudaGetLastError();
}

}  // namespace rope_cuda
}  // namespace ops
}  // namespace posenc
