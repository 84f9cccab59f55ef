// Deterministic, parallel sums over runs of equal keys in a sorted array (the table rows
// of a (batch, seq) positions backward, sorted stably). One thread per run would walk a
// long run alone (padding positions can share one row across most of a batch), so the
// sorted slots are cut into chunks of `chunk` slots:
//   pass 1: one thread per segment (a maximal range of equal keys inside one chunk) sums
//           its slots in order. A segment that is a whole run stores its sum in the
//           table; the segment that starts a run crossing the chunk's end stores it as its
//           chunk's `start` partial; a segment that continues a run from the previous chunk
//           (it begins at the chunk's first slot) stores it as the chunk's `carry` partial.
//   pass 2: one thread per chunk whose last segment starts a crossing run adds that run's
//           carries of the following chunks, in chunk order, and stores the run's sum.
// Every slot is summed once, in ascending order within a chunk and chunk order across
// them: the same result on every run. Serial work per thread is at most `chunk` slots in
// pass 1 and `slots / chunk` partials in pass 2. These helpers are the index logic both
// passes run, shared with a host test that walks them serially (GoogleTest
// SortedRuns.*).
#pragma once

#include <cstdint>

#include "posenc/math/host_device.h"

namespace posenc {
namespace ops {

struct SortedRuns {
  const int64_t* keys;  // ascending
  int64_t slots;        // number of keys
  int64_t chunk;        // slots per chunk, > 0

  POSENC_HOST_DEVICE int64_t chunks() const { return (slots + chunk - 1) / chunk; }
  POSENC_HOST_DEVICE int64_t chunk_end(int64_t c) const {
    return (c + 1) * chunk < slots ? (c + 1) * chunk : slots;
  }
};

// True when `slot` begins a segment (chunk start, or a key change).
POSENC_HOST_DEVICE bool segment_begins(const SortedRuns& r, int64_t slot) {
  return slot % r.chunk == 0 || r.keys[slot - 1] != r.keys[slot];
}

// One past the last slot of the segment that begins at `first`.
POSENC_HOST_DEVICE int64_t segment_end(const SortedRuns& r, int64_t first) {
  const int64_t end = r.chunk_end(first / r.chunk);
  int64_t s = first + 1;
  while (s < end && r.keys[s] == r.keys[first]) ++s;
  return s;
}

enum class SegmentRole {
  kWholeRun,      // pass 1 stores the sum in the table
  kRunStart,      // the sum goes to start[chunk]; pass 2 finishes the run
  kContinuation,  // the sum goes to carry[chunk]
};

// The role of the segment [first, end).
POSENC_HOST_DEVICE SegmentRole segment_role(const SortedRuns& r, int64_t first, int64_t end) {
  if (first > 0 && r.keys[first - 1] == r.keys[first]) return SegmentRole::kContinuation;
  if (end < r.slots && r.keys[end] == r.keys[first]) return SegmentRole::kRunStart;
  return SegmentRole::kWholeRun;
}

// Pass 2: true when chunk c's last segment starts a run that crosses into later chunks;
// the run's key is keys[chunk_end(c) - 1], and its carries are those of chunks c + 1,
// c + 2, ... whose first key is that key.
POSENC_HOST_DEVICE bool chunk_starts_crossing_run(const SortedRuns& r, int64_t c) {
  const int64_t last = r.chunk_end(c) - 1;
  const int64_t key = r.keys[last];
  if (last + 1 >= r.slots || r.keys[last + 1] != key) return false;  // ends in this chunk
  // The last segment begins inside the chunk unless the whole chunk holds the key; then it
  // starts the run only if the previous chunk does not end with the key too.
  const int64_t first = c * r.chunk;
  return !(r.keys[first] == key && first > 0 && r.keys[first - 1] == key);
}

// A chunk size that bounds both passes' serial work by about 2 sqrt(slots).
inline int64_t sorted_runs_chunk(int64_t slots) {
  int64_t c = 64;
  while (c * c < slots && c < (int64_t{1} << 20)) c *= 2;
  return c;
}

}  // namespace ops
}  // namespace posenc
