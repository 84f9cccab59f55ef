// Positions of add_position outside the table: one message, one bounds op.
#pragma once

#include <cstdint>
#include <string>

namespace posenc {
namespace ops {

// Throws the IndexError for an add-position position outside [0, table_len): "posenc:
// expected positions in [0, max_len=L), found V" followed by `where` (e.g. " at flat
// index 4"). The CPU kernels' per-element check and posenc::position_bounds (the modules'
// check of CUDA positions) both report through it.
[[noreturn]] void throw_position_out_of_range(int64_t table_len, int64_t found,
                                              const std::string& where);

// The modules' range check from the smallest and largest position of a call (hi < lo: no
// position): the IndexError above, naming the offending end and the range, unless both lie
// in [0, max_len). The add-position modules (through position_bounds) and the RoPE modules
// (C++ directly, Python through the op position_range_check) share it: one message.
void check_position_range(int64_t lo, int64_t hi, int64_t max_len);

}  // namespace ops
}  // namespace posenc
