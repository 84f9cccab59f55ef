// posenc/sinusoidal_table.h: posenc::sinusoidal_table, which calls the op through the
// dispatcher.
#include "posenc/sinusoidal_table.h"

#include <c10/util/Exception.h>

#include "ops/common/op_handles.h"

namespace posenc {

at::Tensor sinusoidal_table(const at::Tensor& positions, int64_t d_model, double base,
                            std::optional<at::ScalarType> dtype) {
  const at::ScalarType out = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(out == at::kHalf || out == at::kBFloat16 || out == at::kFloat || out == at::kDouble, "posenc: sinusoidal_table: expected dtype to be "
                   "float16, bfloat16, float32 or float64, got ", out);
  // The op returns float64; one rounding to `out` here (ops/sinusoidal_table/sinusoidal_table.cpp
  // says why).
  return ops::sinusoidal_table_op().call(positions, c10::SymInt(d_model), base).to(out);
}

}  // namespace posenc
