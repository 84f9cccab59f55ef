// GoogleTest: the work split of two CUDA kernels (csrc/ops/common/cuda_work_split.h), walked
// serially on the host with the kernels' own loop structure: every item done exactly once,
// nothing outside the tensors touched. The kernels run only on a GPU; their index
// functions run here.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "ops/common/cuda_work_split.h"

namespace {

using posenc::ops::RopeBlockShape;
using posenc::ops::RopeThreadRole;
using posenc::ops::TableTiles;

// add_position_backward_table_kernel: blocks (s, tile), threads (x, y). Every (b, s, group)
// summed once; every (s, column) stored once by the slice reduction.
void walk_table(int64_t batch, int64_t seq, int64_t d) {
  constexpr int kThreads = 256;
  const int64_t groups = (d + 7) / 8;
  const TableTiles t = posenc::ops::table_tiles(groups, kThreads);
  ASSERT_EQ(t.width * t.slices, kThreads);
  ASSERT_LE(t.width, 32);
  std::vector<int> summed(batch * seq * groups, 0), stored(seq * d, 0);
  for (int64_t block = 0; block < seq * t.tiles_per_row; ++block) {
    const int64_t s = block / t.tiles_per_row;
    const int64_t tile = block - s * t.tiles_per_row;
    for (int y = 0; y < t.slices; ++y) {
      for (int x = 0; x < t.width; ++x) {
        const int64_t group = tile * t.width + x;
        int64_t begin, end;
        posenc::ops::table_batch_slice(batch, t.slices, y, &begin, &end);
        if (group >= groups) continue;
        for (int64_t b = begin; b < end; ++b) {
          ASSERT_GE(b, 0);
          ASSERT_LT(b, batch);
          ++summed[(b * seq + s) * groups + group];
        }
      }
    }
    // The reduction: thread c < width * 8 stores column tile * width * 8 + c.
    for (int c = 0; c < kThreads; ++c) {
      const int64_t j = tile * t.width * 8 + c;
      if (c < t.width * 8 && j < d) ++stored[s * d + j];
    }
  }
  for (size_t i = 0; i < summed.size(); ++i) ASSERT_EQ(summed[i], 1) << "item " << i;
  for (size_t i = 0; i < stored.size(); ++i) ASSERT_EQ(stored[i], 1) << "column " << i;
}

TEST(WorkSplit, TableBackwardSumsEveryRowOnceAndStoresEveryColumnOnce) {
  walk_table(32, 16, 512);   // wide rows: 2 tiles of 32 groups, 8 slices of 4 rows
  walk_table(256, 7, 768);   // ViT-like: 3 tiles
  walk_table(3, 5, 64);      // 8 groups: width 8, 32 slices, most empty
  walk_table(1, 3, 20);      // d % 8 != 0: a partial group
  walk_table(1000, 2, 8);    // one group: width 1, 256 slices of 4 rows
  walk_table(7, 1, 4104);    // 513 groups: a partial last tile
  std::mt19937_64 gen(7);
  for (int i = 0; i < 40; ++i) {
    walk_table(1 + gen() % 300, 1 + gen() % 9, 1 + gen() % 700);
  }
}

// rope_kernel and rope_cos_sin_kernel: blocks walk steps of `slots` tokens grid-stride;
// within a step, thread (slot, lane, chunk) rotates pairs [chunk P, chunk P + P) of heads
// lane, lane + head_lanes, ...; the cos/sin loop (angles, or the staged tables) fills slot
// sl's pair p at i = sl * half + p; the pass-through copies features j = chunk P +
// n chunks P, P at a time.
void walk_rope(int64_t tokens, int64_t heads, int64_t half, int64_t pass, int P, int grid) {
  constexpr int kMaxThreads = 256, kMaxPairs = 256, kMaxSlots = 32;
  const RopeBlockShape shape =
      posenc::ops::rope_block_shape(half, heads, tokens, P, kMaxThreads, kMaxPairs, kMaxSlots);
  ASSERT_LE(shape.threads(), kMaxThreads);
  ASSERT_LE(shape.slots * half, kMaxPairs);
  ASSERT_TRUE(posenc::ops::rope_block_shape_fits(shape, half, kMaxThreads, kMaxPairs));
  std::vector<int> rotated(tokens * heads * half, 0), angle(tokens * half, 0);
  std::vector<int> copied(tokens * heads * pass, 0), started(tokens, 0);
  const int64_t step = static_cast<int64_t>(grid) * shape.slots;
  for (int block = 0; block < grid; ++block) {
    for (int tid = 0; tid < shape.threads(); ++tid) {
      const RopeThreadRole r = posenc::ops::rope_thread_role(shape, tid);
      ASSERT_LT(r.slot, shape.slots);
      ASSERT_LT(r.lane, shape.head_lanes);
      ASSERT_LT(r.chunk, shape.chunks);
      int64_t token = static_cast<int64_t>(block) * shape.slots + r.slot;
      if (r.leader && token < tokens) ++started[token];
      for (; token - r.slot < tokens; token += step) {
        if (r.leader && token + step < tokens) ++started[token + step];
        for (int i = tid; i < shape.slots * half; i += shape.threads()) {
          const int64_t t = token - r.slot + i / half;
          if (t < tokens) ++angle[t * half + i % half];
        }
        if (token >= tokens) continue;
        const int64_t p0 = static_cast<int64_t>(r.chunk) * P;
        for (int64_t h = r.lane; h < heads; h += shape.head_lanes) {
          for (int k = 0; k < P; ++k) {
            ASSERT_LT(p0 + k, half);
            ++rotated[(token * heads + h) * half + p0 + k];
          }
          for (int64_t j = p0; j < pass; j += static_cast<int64_t>(shape.chunks) * P) {
            for (int64_t k = 0; k < P && j + k < pass; ++k) ++copied[(token * heads + h) * pass + j + k];
          }
        }
      }
    }
  }
  for (size_t i = 0; i < rotated.size(); ++i) ASSERT_EQ(rotated[i], 1) << "pair " << i;
  for (size_t i = 0; i < angle.size(); ++i) ASSERT_EQ(angle[i], 1) << "angle " << i;
  for (size_t i = 0; i < copied.size(); ++i) ASSERT_EQ(copied[i], 1) << "feature " << i;
  for (size_t i = 0; i < started.size(); ++i) ASSERT_EQ(started[i], 1) << "token " << i;
}

TEST(WorkSplit, RopeRotatesEveryPairOnceAndEvaluatesEveryAngleOnce) {
  walk_rope(64, 40, 64, 0, 8, 5);   // LLaMA-like: 32 q + 8 k heads, bf16 16-byte path
  walk_rope(9, 1, 64, 0, 8, 2);     // one head: 4 tokens a block
  walk_rope(100, 2, 4, 24, 4, 3);   // partial rotary, float path
  walk_rope(33, 3, 13, 7, 1, 4);    // element path, odd sizes
  walk_rope(5, 12, 256, 0, 2, 8);   // rotary_dim 512, more blocks than steps
  walk_rope(7, 3, 256, 5, 1, 3);    // rotary_dim 512 on the element path: 256 chunks
  walk_rope(1, 1, 1, 1, 1, 1);
  std::mt19937_64 gen(11);
  for (int i = 0; i < 60; ++i) {
    const int P = 1 << (gen() % 4);  // 1, 2, 4, 8
    const int64_t half = P * (1 + static_cast<int64_t>(gen() % (256 / P)));
    walk_rope(1 + gen() % 70, 1 + gen() % 48, half, gen() % 3 == 0 ? gen() % 40 : 0, P,
              1 + static_cast<int>(gen() % 9));
  }
}

// rotary_dim > 512 (half > 256) is refused by every RoPE op's checks before dispatch; the
// shape rope_block_shape gives for it must not pass rope_block_shape_fits, which the CUDA
// launcher asserts: on the element path it needs a thread per pair, and with any P one slot
// holds more pairs than the shared tables (the out-of-bounds write of issue 26, item 1).
TEST(WorkSplit, RopeShapeBeyondMaxPairsDoesNotFit) {
  constexpr int kMaxThreads = 256, kMaxPairs = 256, kMaxSlots = 32;
  for (int P : {1, 2, 4, 8}) {
    for (int64_t half : {P, 64, 256}) {
      const RopeBlockShape fits =
          posenc::ops::rope_block_shape(half, 40, 100, P, kMaxThreads, kMaxPairs, kMaxSlots);
      EXPECT_TRUE(posenc::ops::rope_block_shape_fits(fits, half, kMaxThreads, kMaxPairs))
          << "P " << P << " half " << half;
    }
    for (int64_t half : {257, 288, 1024}) {
      const RopeBlockShape over =
          posenc::ops::rope_block_shape(half, 40, 100, P, kMaxThreads, kMaxPairs, kMaxSlots);
      EXPECT_EQ(over.slots, 1);
      EXPECT_FALSE(posenc::ops::rope_block_shape_fits(over, half, kMaxThreads, kMaxPairs))
          << "P " << P << " half " << half;
    }
  }
}

}  // namespace
