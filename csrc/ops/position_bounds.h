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

}  // namespace ops
}  // namespace posenc
