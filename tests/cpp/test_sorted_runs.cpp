// GoogleTest: the index logic of the CUDA table backward for (batch, seq) positions
// (csrc/ops/common/sorted_runs.h), walked serially on the host: every slot summed once, every
// run stored once with the sum of its slots, whatever the chunk size.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "ops/common/sorted_runs.h"

namespace {

using posenc::ops::SegmentRole;
using posenc::ops::SortedRuns;

// Sorted keys with runs of very different lengths (some far longer than a chunk).
std::vector<int64_t> make_keys(std::mt19937_64& gen, int64_t slots) {
  std::vector<int64_t> keys;
  int64_t key = static_cast<int64_t>(gen() % 5);
  while (static_cast<int64_t>(keys.size()) < slots) {
    const uint64_t kind = gen() % 4;
    int64_t length = kind == 0 ? 1 + static_cast<int64_t>(gen() % 3)
                     : kind == 1 ? 1 + static_cast<int64_t>(gen() % 40)
                     : kind == 2 ? 1 + static_cast<int64_t>(gen() % 700)
                                 : 1;
    for (int64_t i = 0; i < length && static_cast<int64_t>(keys.size()) < slots; ++i) keys.push_back(key);
    key += 1 + static_cast<int64_t>(gen() % 3);
  }
  return keys;
}

TEST(SortedRuns, TwoPassesSumEveryRunOnce) {
  std::mt19937_64 gen(7);
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t slots = 1 + static_cast<int64_t>(gen() % 3000);
    const std::vector<int64_t> keys = make_keys(gen, slots);
    std::vector<int64_t> values(slots);
    std::map<int64_t, int64_t> want;
    for (int64_t s = 0; s < slots; ++s) {
      values[s] = static_cast<int64_t>(gen() % 1000003);
      want[keys[s]] += values[s];
    }
    for (int64_t chunk : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{7}, int64_t{64},
                          posenc::ops::sorted_runs_chunk(slots)}) {
      const SortedRuns r{keys.data(), slots, chunk};
      const int64_t chunks = r.chunks();
      std::vector<int64_t> covered(slots, 0), start(chunks, -1), carry(chunks, -1);
      std::map<int64_t, int64_t> table;
      // Pass 1: one "thread" per segment.
      for (int64_t slot = 0; slot < slots; ++slot) {
        if (!posenc::ops::segment_begins(r, slot)) continue;
        const int64_t end = posenc::ops::segment_end(r, slot);
        ASSERT_LE(end - slot, chunk);
        int64_t sum = 0;
        for (int64_t s = slot; s < end; ++s) {
          ASSERT_EQ(keys[s], keys[slot]);
          ++covered[s];
          sum += values[s];
        }
        const int64_t c = slot / chunk;
        switch (posenc::ops::segment_role(r, slot, end)) {
          case SegmentRole::kWholeRun:
            ASSERT_EQ(table.count(keys[slot]), 0u) << "a run stored twice";
            table[keys[slot]] = sum;
            break;
          case SegmentRole::kRunStart:
            ASSERT_EQ(end, r.chunk_end(c)) << "a crossing run starts in the chunk's last segment";
            ASSERT_EQ(start[c], -1);
            start[c] = sum;
            break;
          case SegmentRole::kContinuation:
            ASSERT_EQ(slot, c * chunk) << "a continuation begins at its chunk's first slot";
            ASSERT_EQ(carry[c], -1);
            carry[c] = sum;
            break;
        }
      }
      // Pass 2: one "thread" per chunk.
      for (int64_t c = 0; c < chunks; ++c) {
        if (!posenc::ops::chunk_starts_crossing_run(r, c)) continue;
        const int64_t key = keys[r.chunk_end(c) - 1];
        ASSERT_NE(start[c], -1) << "pass 2 reads a start pass 1 wrote";
        int64_t sum = start[c];
        for (int64_t j = c + 1; j < chunks && keys[j * chunk] == key; ++j) {
          ASSERT_NE(carry[j], -1) << "pass 2 reads carries pass 1 wrote";
          sum += carry[j];
        }
        ASSERT_EQ(table.count(key), 0u) << "a run stored twice";
        table[key] = sum;
      }
      for (int64_t s = 0; s < slots; ++s) ASSERT_EQ(covered[s], 1) << "slot " << s;
      ASSERT_EQ(table, want) << "slots " << slots << ", chunk " << chunk;
    }
  }
}

TEST(SortedRuns, ChunkBoundsTheSerialWork) {
  for (int64_t slots : {int64_t{1}, int64_t{100}, int64_t{4096}, int64_t{131072}, int64_t{1} << 24}) {
    const int64_t chunk = posenc::ops::sorted_runs_chunk(slots);
    EXPECT_GE(chunk, 64);
    EXPECT_LE((slots + chunk - 1) / chunk, std::max<int64_t>(chunk, 1)) << slots;
  }
}

}  // namespace
