// CUDA kernels of the rope ops (out of place and in place; the backward is the same kernel
// with inverse=true).
//
// A block holds one or more tokens (`slots`: as many as fit 256 threads, so calls with few
// heads still fill a block) and walks the tokens grid-stride, one block-full per step. Per
// step, each thread first loads its first head's pairs, then the block evaluates its
// tokens' cos/sin into shared memory (every thread a share; angle formed and reduced in
// float64 with posenc/math/rope.h, so accurate at any position; multi-axis RoPE reads the
// pair's position axis), one barrier, then thread (lane, c) rotates chunk c of P
// consecutive pairs of heads lane, lane + head_lanes, ... of q then k. The shared buffers
// are doubled so one barrier per step suffices, and the loads of the first head are in
// flight during the sin/cos evaluation. Each token's start (offsets, the packed-sequence
// search of "thd") is computed once, by one thread, a step ahead.
//
// Fast path (last dimension contiguous, 16-byte aligned rows, rotary_dim/2 a multiple of
// P): each chunk is one 16-byte load and store per half (rotate_half layout) or two
// consecutive ones (interleaved layout), and the partial-rotary pass-through copies 16
// bytes at a time; otherwise P = 1 with element accesses and any strides. The frequencies
// travel in the kernel parameters (__grid_constant__, no copy); no host-device
// synchronisation anywhere. The rotation rounds as the CPU kernel does
// (math::rope_rotate_pair), so results do not depend on the path taken.
#include <algorithm>
#include <limits>

#include "../common/occupancy.cuh"
#include "../common/rope_device_checks.cuh"
#include "../common/rope_pairs.cuh"
#include "../common/vector_access.cuh"
#include "launch.h"
#include "ops/common/cuda_work_split.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {
namespace {

using cuda::Pack;
using namespace rope_cuda;  // load_pairs, store_pairs, head_rows, copy_pass_through

// Register budget: 3 blocks of 256 threads per SM (80 registers a thread). At 64 (4
// blocks) ptxas spilled the loop state of the 16-byte paths once a step's first loads were
// hoisted above the sin/cos evaluation; 768 threads, each with its head's two 16-byte loads
// in flight, keep 24 KiB of loads in flight per SM (Little's law at HBM3 rates). tests/cpp/
// check_cuda_kernels.py checks the budget and that nothing spills.
constexpr int kMinBlocksPerSm = 3;

// Where a token starts (rope_token_shift), computed by one thread and shared by its slot.
struct TokenStart {
  int64_t shift, restart;
  int valid;
};

// A token's start: the packed-sequence search's result (ops/common/rope_launch.h).
__device__ __forceinline__ void assert_token_start(const RopeArgs& a, const TokenStart& t) {
  rope_cuda::assert_token_start(a, t.valid != 0, t.shift);
}

// Thread layout: ops/common/cuda_work_split.h (RopeBlockShape, rope_thread_role): a block holds
// `slots` tokens side by side; within a slot, thread (lane, c) owns the chunk c of P
// consecutive pairs of heads lane, lane + head_lanes, ... of the token. Several tokens per
// block when a token has fewer than 256 (head, chunk) work items (few heads, or short
// heads), so small calls still fill the block. The block walks its tokens grid-stride, one
// group of `slots` tokens per step.
template <typename scalar_t, int P, bool kVec>
__global__ void __launch_bounds__(kRopeThreads, kMinBlocksPerSm)
    rope_kernel(const __grid_constant__ RopeArgs a, RopeBlockShape shape) {
  using acc_t = cuda::opmath_t<scalar_t>;
  const int64_t tokens = a.batch * a.seq;
  const int half = static_cast<int>(a.rotary_dim / 2);
  const int64_t pass = a.head_dim - a.rotary_dim;
  const RopeThreadRole role = rope_thread_role(shape, threadIdx.x);
  const int slot = role.slot, c = role.chunk, lane = role.lane;
  const bool leader = role.leader;
  const int64_t p0 = static_cast<int64_t>(c) * P;
  const acc_t factor = static_cast<acc_t>(a.attention_factor);
  const acc_t sign = a.inverse ? acc_t(-1) : acc_t(1);
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  const int64_t step = static_cast<int64_t>(gridDim.x) * shape.slots;
  // Two buffers of the tokens' cos/sin and starts: step i writes buffer i % 2 while the
  // slower threads may still read buffer (i - 1) % 2, so one barrier per step suffices.
  __shared__ double s_freq[kMaxRopePairs];
  __shared__ acc_t s_cos[2][kMaxRopePairs];
  __shared__ acc_t s_sin[2][kMaxRopePairs];
  __shared__ TokenStart s_start[2][kRopeMaxSlots];
  for (int i = threadIdx.x; i < half; i += blockDim.x) s_freq[i] = a.inv_freq[i];
  int64_t token = static_cast<int64_t>(blockIdx.x) * shape.slots + slot;
  if (leader && token < tokens) {
    TokenStart& t = s_start[0][slot];
    t.valid = rope_token_shift(a, token / a.seq, token % a.seq, &t.shift, &t.restart);
    assert_token_start(a, t);
  }
  assert_cu_seqlens(a);
  __syncthreads();

  for (int buf = 0; token - slot < tokens; token += step, buf ^= 1) {
    const bool live = token < tokens;
    const int64_t b = token / a.seq;
    const int64_t s = token - b * a.seq;
    TokenStart start{0, 0, 0};
    if (live) start = s_start[buf][slot];
    // The first head's pairs are loaded before the sin/cos are evaluated, so the loads are
    // in flight during the float64 angle reduction and the barrier.
    const bool rotates = live && half > 0;
    RawPairs<scalar_t, P, kVec> raw;
    if (rotates) raw = load_first_head<scalar_t, P, kVec>(a, b, s, lane, p0);
    // The cos/sin of the block's tokens, every thread a share of slots * half pairs.
    for (int i = threadIdx.x; i < shape.slots * half; i += blockDim.x) {
      const int sl = i / half;
      const int pair = i - sl * half;
      const int64_t t = token - slot + sl;
      acc_t sv = nan, cv = nan;
      if (t < tokens) {
        const TokenStart ts = s_start[buf][sl];
        if (ts.valid) {
          const int64_t tb = t / a.seq;
          const int64_t pos =
              rope_axis_position(a, tb, t - tb * a.seq, ts.shift, ts.restart, a.pair_axis[pair]);
          CUDA_KERNEL_ASSERT_MSG(rope_in_position_domain(pos - ts.shift),
                                 "posenc: rope: expected positions within " POSENC_ROPE_POSITION_RANGE);
          math::rope_sincos<acc_t>(pos, s_freq[pair], &sv, &cv);
        }
      }
      s_cos[buf][i] = cv * factor;
      s_sin[buf][i] = sv * factor * sign;
    }
    // The next step's token starts (the packed-sequence search), by the slot's leader.
    if (leader && token + step < tokens) {
      const int64_t next = token + step;
      TokenStart& t = s_start[buf ^ 1][slot];
      t.valid = rope_token_shift(a, next / a.seq, next % a.seq, &t.shift, &t.restart);
      assert_token_start(a, t);
    }
    __syncthreads();
    if (rotates) {
      // cos/sin are read from shared memory for every head (LDS is cheap; kept in registers
      // across the head loop they pushed the 16-bit paths into spilling).
      const acc_t* cs = &s_cos[buf][slot * half + p0];
      const acc_t* sn = &s_sin[buf][slot * half + p0];
      rotate_heads<scalar_t, acc_t, P, kVec>(
          a, b, s, lane, shape.head_lanes, p0, raw,
          [=](int k, acc_t x1, acc_t x2, acc_t* y1, acc_t* y2) {
            math::rope_rotate_pair(x1, x2, cs[k], sn[k], y1, y2);
          });
    }
    // Features beyond rotary_dim pass through (nothing to do in place, unless invalid),
    // P at a time by the same (lane, chunk) threads: no division per element. Both operands
    // are asked: a q without elements has in == out == nullptr even out of place, and k's
    // pass-through features must still be copied then.
    if (live && pass > 0 && (a.q.in != a.q.out || a.k.in != a.k.out || !start.valid)) {
      pass_through_heads<scalar_t, P, kVec>(a, b, s, lane, shape.head_lanes, shape.chunks, p0,
                                            start.valid);
    }
  }
}

}  // namespace

template <typename scalar_t>
cudaError_t launch_rope(const RopeArgs& a, cudaStream_t stream) {
  if (a.batch * a.seq == 0 || a.q.heads + a.k.heads == 0 || a.head_dim == 0) return cudaSuccess;
  constexpr int P = cuda::kPerVector<scalar_t>;
  if (rope_can_vectorize(a, P)) return launch_rope_kernel(rope_kernel<scalar_t, P, true>, a, P, stream);
  return launch_rope_kernel(rope_kernel<scalar_t, 1, false>, a, 1, stream);
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_rope, const RopeArgs&, cudaStream_t)

}  // namespace ops
}  // namespace posenc
