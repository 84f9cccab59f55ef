// How the CUDA kernels split their work over blocks and threads, as plain functions of the
// sizes and the block/thread indices: the kernels call them, and tests/cpp/test_work_split.cpp
// walks every block and thread on the CPU and checks that each item is done exactly once
// (the kernels themselves run only on a GPU).
#pragma once

#include <algorithm>
#include <cstdint>

#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {

// ---- Learned-table backward, positions per s (cuda/add_position/add_position.cu).
// A block per (s, tile of `width` groups of 8 columns); its threads are (x < width, y <
// slices), slice y summing batch rows [begin, end) of column group tile * width + x.
struct TableTiles {
  int width;              // column groups per tile: the row's groups, up to a warp's 32
  int slices;             // batch slices: the rest of the block's threads
  int64_t tiles_per_row;  // blocks per s
};

inline TableTiles table_tiles(int64_t groups_per_row, int threads) {
  int width = 1;
  while (width < 32 && width < groups_per_row) width *= 2;
  return {width, threads / width, (groups_per_row + width - 1) / width};
}

POSENC_HOST_DEVICE void table_batch_slice(int64_t batch, int slices, int y, int64_t* begin,
                                          int64_t* end) {
  const int64_t per_slice = (batch + slices - 1) / slices;
  *begin = y * per_slice;
  *end = *begin + per_slice < batch ? *begin + per_slice : batch;
}

// ---- RoPE (cuda/rope/rope.cu, cuda/rope_cos_sin/rope_cos_sin.cu). A block holds `slots` tokens;
// within a slot, thread (lane, chunk) owns pairs [chunk * P, chunk * P + P) of heads lane,
// lane + head_lanes, ...
struct RopeBlockShape {
  int chunks, head_lanes, slots;
  int threads() const { return chunks * head_lanes * slots; }
};

// half: pairs per head (a multiple of P on the 16-byte path); heads: of q and k together.
// Slots: as many tokens as fit max_threads, max_pairs shared cos/sin values and max_slots.
inline RopeBlockShape rope_block_shape(int64_t half, int64_t heads, int64_t tokens, int P,
                                       int max_threads, int64_t max_pairs, int max_slots) {
  RopeBlockShape s;
  s.chunks = static_cast<int>(std::max<int64_t>(1, (half + P - 1) / P));
  s.head_lanes = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(heads, max_threads / s.chunks)));
  const int per_slot = s.chunks * s.head_lanes;
  s.slots = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({max_threads / per_slot, max_pairs / std::max<int64_t>(half, 1),
                            static_cast<int64_t>(max_slots), tokens})));
  return s;
}

// Whether the shape stays within the block's limits: at most max_threads threads (a thread
// per chunk of P pairs, so half <= max_threads * P) and slots * half <= max_pairs shared
// table values. rope_block_shape clamps slots and head_lanes but not chunks, so a half
// beyond max_pairs (rotary_dim > 512; the op checks refuse it) gives a shape that does not
// fit: the launcher refuses that instead of writing past the shared tables.
inline bool rope_block_shape_fits(const RopeBlockShape& s, int64_t half, int max_threads,
                                  int64_t max_pairs) {
  return s.threads() <= max_threads && s.slots * half <= max_pairs;
}

struct RopeThreadRole {
  int slot, lane, chunk;
  bool leader;  // the slot's first thread: computes its tokens' starts
};

POSENC_HOST_DEVICE RopeThreadRole rope_thread_role(const RopeBlockShape& s, int tid) {
  const int per_slot = s.chunks * s.head_lanes;
  RopeThreadRole r;
  r.slot = tid / per_slot;
  r.chunk = tid % s.chunks;
  r.lane = (tid - r.slot * per_slot) / s.chunks;
  r.leader = tid == r.slot * per_slot;
  return r;
}

}  // namespace ops
}  // namespace posenc
