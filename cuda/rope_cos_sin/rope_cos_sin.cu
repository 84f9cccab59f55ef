// CUDA kernel of apply_rope_cos_sin: the rotation with given cos/sin tables (Hugging Face's
// x * cos + rotate_half(x) * sin, or GPT-J's interleaved pairs), math::rope_rotate_pair_tables
// as on the CPU, in float32 (float64 for float64). The work split is the rope kernel's
// (ops/common/cuda_work_split.h): a block holds one or more tokens, thread (lane, c) rotates chunk
// c of P pairs of heads lane, lane + head_lanes, ... of q then k, with the pair helpers of
// cuda/common/rope_pairs.cuh. Per step the block stages its tokens' table values in shared memory
// (each value read once per block, not once per head), after issuing the first head's
// loads; one barrier per step. On the fast path (16-byte aligned rows of q and k,
// rotary_dim / 2 a multiple of P) x moves in 16-byte accesses; otherwise P = 1 with element
// accesses and any strides. No host-device synchronisation.
#include <algorithm>

#include "../common/occupancy.cuh"
#include "../common/rope_pairs.cuh"
#include "../common/vector_access.cuh"
#include "launch.h"
#include "ops/common/cuda_work_split.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace {

using namespace rope_cuda;  // load_pairs, unpack_pairs, store_pairs, head_rows

// Register budget: 3 blocks of 256 threads per SM (80 registers), as the rope kernel. The
// chunk's table values come from shared memory per head: held in registers (4P values)
// they spilled at 80.
constexpr int kMinBlocksPerSm = 3;

template <typename scalar_t, int P, bool kVec>
__global__ void __launch_bounds__(kRopeThreads, kMinBlocksPerSm)
    rope_cos_sin_kernel(const __grid_constant__ RopeCosSinArgs a, RopeBlockShape shape) {
  using acc_t = cuda::opmath_t<scalar_t>;
  const int64_t tokens = a.batch * a.seq;
  const int half = static_cast<int>(a.rotary_dim / 2);
  const int64_t heads = a.q.heads + a.k.heads;
  const int64_t pass = a.head_dim - a.rotary_dim;
  const RopeThreadRole role = rope_thread_role(shape, threadIdx.x);
  const int slot = role.slot, lane = role.lane;
  const int64_t p0 = static_cast<int64_t>(role.chunk) * P;
  const int64_t step = static_cast<int64_t>(gridDim.x) * shape.slots;
  // The block's tokens' table values per pair, (c1, s1) at the pair's first feature and
  // (c2, s2) at its second, double-buffered: one barrier per step (as the rope kernel).
  __shared__ acc_t s_tab[2][4][kMaxRopePairs];
  int64_t token = static_cast<int64_t>(blockIdx.x) * shape.slots + slot;
  for (int buf = 0; token - slot < tokens; token += step, buf ^= 1) {
    const bool live = token < tokens;
    const int64_t b = token / a.seq;
    const int64_t s = token - b * a.seq;
    // The first head's pairs are loaded before the tables are staged.
    const bool rotates = live && half > 0;
    RawPairs<scalar_t, P, kVec> raw;
    if (rotates) {
      const scalar_t* in;
      scalar_t* out;
      int64_t in_sd, out_sd;
      head_rows<scalar_t>(a, b, s, lane, &in, &out, &in_sd, &out_sd);
      raw = load_pairs<scalar_t, P, kVec>(in, in_sd, half, a.interleaved, p0);
    }
    for (int i = threadIdx.x; i < shape.slots * half; i += blockDim.x) {
      const int sl = i / half;
      const int pair = i - sl * half;
      const int64_t t = token - slot + sl;
      if (t >= tokens) continue;
      const int64_t tb = t / a.seq;
      const int64_t row = tb * a.table_batch_stride + (t - tb * a.seq) * a.rotary_dim;
      int64_t e1, e2;
      math::rope_pair_features(pair, half, a.interleaved, &e1, &e2);
      const acc_t* cs = static_cast<const acc_t*>(a.cos) + row;
      const acc_t* sn = static_cast<const acc_t*>(a.sin) + row;
      s_tab[buf][0][i] = __ldg(cs + e1);
      s_tab[buf][1][i] = __ldg(sn + e1);
      s_tab[buf][2][i] = __ldg(cs + e2);
      s_tab[buf][3][i] = __ldg(sn + e2);
    }
    __syncthreads();
    // The head loop is rope_pairs.cuh's rotate_heads written out: through that helper (a
    // lambda reading the staged tables) the 16-bit paths spilled 12 bytes at 80 registers
    // (ctest cuda_kernel_resources).
    if (rotates) {
      const int64_t first = slot * half + p0;
      for (int64_t h = lane;;) {
        const scalar_t* in;
        scalar_t* out;
        int64_t in_sd, out_sd;
        head_rows<scalar_t>(a, b, s, h, &in, &out, &in_sd, &out_sd);
        acc_t x1[P], x2[P], y1[P], y2[P];
        unpack_pairs<scalar_t, acc_t, P, kVec>(raw, a.interleaved, x1, x2);
#pragma unroll
        for (int k = 0; k < P; ++k) {
          math::rope_rotate_pair_tables<acc_t>(
              x1[k], x2[k], s_tab[buf][0][first + k], s_tab[buf][1][first + k],
              s_tab[buf][2][first + k], s_tab[buf][3][first + k], a.transpose, &y1[k], &y2[k]);
        }
        store_pairs<scalar_t, acc_t, P, kVec>(out, out_sd, half, a.interleaved, p0, y1, y2);
        h += shape.head_lanes;
        if (h >= heads) break;
        head_rows<scalar_t>(a, b, s, h, &in, &out, &in_sd, &out_sd);
        raw = load_pairs<scalar_t, P, kVec>(in, in_sd, half, a.interleaved, p0);
      }
    }
    if (live && pass > 0) {  // partial rotary: the other features are copied (out of place)
      pass_through_heads<scalar_t, P, kVec>(a, b, s, lane, shape.head_lanes, shape.chunks, p0,
                                            true);
    }
  }
}

}  // namespace

template <typename scalar_t>
cudaError_t launch_rope_cos_sin(const RopeCosSinArgs& a, cudaStream_t stream) {
  if (a.batch * a.seq == 0 || a.q.heads + a.k.heads == 0 || a.head_dim == 0) return cudaSuccess;
  constexpr int P = cuda::kPerVector<scalar_t>;
  if (rope_can_vectorize(a, P)) {
    return launch_rope_kernel(rope_cos_sin_kernel<scalar_t, P, true>, a, P, stream);
  }
  return launch_rope_kernel(rope_cos_sin_kernel<scalar_t, 1, false>, a, 1, stream);
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_rope_cos_sin, const RopeCosSinArgs&, cudaStream_t)

}  // namespace ops
}  // namespace posenc
