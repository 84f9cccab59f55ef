// posenc::position_bounds: the smallest and largest value of an add_position positions
// tensor, computed on its device and read back once (one device sync on CUDA), and, given
// max_len, the range check of the add-position modules (Python and C++): IndexError unless
// every position lies in [0, max_len). The modules call it for CUDA positions in eager mode
// (CPU positions are checked inside the kernel, where reading them costs nothing).
#include "ops/add_position/position_bounds.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ops/common/py_format.h"

namespace posenc {
namespace ops {

void throw_position_out_of_range(int64_t table_len, int64_t found, const std::string& where) {
  C10_THROW_ERROR(IndexError, c10::str("posenc: expected positions in [0, max_len=", table_len,
                                       "), found ", found, where));
}

void check_position_range(int64_t lo, int64_t hi, int64_t max_len) {
  if (hi < lo || (lo >= 0 && hi < max_len)) return;
  throw_position_out_of_range(max_len, lo < 0 ? lo : hi,
                              c10::str(" (positions range from ", lo, " to ", hi, ")"));
}

namespace {

void position_range_check(int64_t lo, int64_t hi, int64_t max_len) {
  check_position_range(lo, hi, max_len);
}

std::tuple<int64_t, int64_t> position_bounds(const at::Tensor& positions,
                                             std::optional<int64_t> max_len) {
  TORCH_CHECK_TYPE(!positions.is_floating_point() && !positions.is_complex() &&
                       positions.scalar_type() != at::kBool,
                   "position_bounds: expected integer positions, got ",
                   py_dtype(positions.scalar_type()));
  if (max_len.has_value()) {
    TORCH_CHECK_VALUE(*max_len >= 0, "position_bounds: expected max_len >= 0, got ", *max_len);
  }
  if (positions.numel() == 0) return {0, -1};  // no position, nothing read back
  auto [lo, hi] = at::aminmax(positions.to(at::kLong));
  const at::Tensor both = at::stack({lo, hi}).to(at::kCPU);  // the one read-back
  const int64_t* v = both.const_data_ptr<int64_t>();
  if (max_len.has_value()) check_position_range(v[0], v[1], *max_len);
  return {v[0], v[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (min, max) of positions, (0, -1) when empty; with max_len, IndexError unless all lie
  // in [0, max_len). Reads values, so it has no Meta form: the modules skip it under
  // torch.compile.
  m.def("position_bounds(Tensor positions, int? max_len=None) -> (int, int)");
  // The same range check from (min, max) already known (the RoPE modules'); no tensor, so
  // one kernel for every backend.
  m.def("position_range_check(int lo, int hi, int max_len) -> ()", &position_range_check);
}

// Composed of ATen ops, so one kernel serves every backend.
TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("position_bounds", &position_bounds);
}

}  // namespace ops
}  // namespace posenc
