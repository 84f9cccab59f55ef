// posenc/sinusoidal_table.h: posenc::sinusoidal_table, which calls the op through the
// dispatcher.
#include "posenc/sinusoidal_table.h"

#include "ops/common/op_handles.h"
#include "ops/common/py_format.h"

namespace posenc {

at::Tensor sinusoidal_table(const at::Tensor& positions, int64_t d_model, double base,
                            std::optional<at::ScalarType> dtype) {
  // The op takes the dtype by name (ops/sinusoidal_table/sinusoidal_table.cpp says why) and
  // raises TypeError for any other than its four.
  return ops::sinusoidal_table_op().call(positions, c10::SymInt(d_model), base, ops::dtype_name(dtype.value_or(at::kFloat)));
}

}  // namespace posenc
