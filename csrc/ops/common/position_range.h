// Positions outside a table of max_len rows: one message for every family. The add-position
// kernels and modules (ops/add_position/add_position.cpp: the per-element CPU check and the
// op position_bounds) and the RoPE modules (C++ in api/rope.cpp, Python through the op
// position_range_check and position_run_check) all report through it.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <limits>
#include <string>

namespace posenc {
namespace ops {

// Throws the IndexError for a position outside [0, table_len): "posenc: expected positions
// in [0, max_len=L), found V" followed by `where` (e.g. " at flat index 4").
[[noreturn]] inline void throw_position_out_of_range(int64_t table_len, int64_t found,
                                                     const std::string& where) {
  C10_THROW_ERROR(IndexError, c10::str("posenc: expected positions in [0, max_len=", table_len,
                                       "), found ", found, where));
}

// The modules' range check from the smallest and largest position of a call (hi < lo: no
// position): the IndexError above, naming the offending end and the range, unless both lie
// in [0, max_len).
inline void check_position_range(int64_t lo, int64_t hi, int64_t max_len) {
  if (hi < lo || (lo >= 0 && hi < max_len)) return;
  throw_position_out_of_range(max_len, lo < 0 ? lo : hi,
                              c10::str(" (positions range from ", lo, " to ", hi, ")"));
}

// The same check for the run first .. first + count - 1 (an offset and a sequence length: no
// tensor to read): first + count - 1 may lie past INT64_MAX, and so past any max_len, where
// the first position out of range is first or max_len.
inline void check_position_run(int64_t first, int64_t count, int64_t max_len) {
  if (count <= 0) return;  // no token, no bound
  if (first > std::numeric_limits<int64_t>::max() - (count - 1)) {
    throw_position_out_of_range(max_len, first < max_len ? max_len : first,
                                c10::str(" (positions range from ", first, " to ", first, " + ", count - 1, ")"));
  }
  check_position_range(first, first + (count - 1), max_len);
}

}  // namespace ops
}  // namespace posenc
