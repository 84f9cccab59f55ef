// posenc/ops.h: C++ entry points that call the ops through the dispatcher.
#include "posenc/ops.h"

#include "ops/common/op_handles.h"

namespace posenc {

at::Tensor sinusoidal_table(const at::Tensor& positions, int64_t d_model, double base,
                            std::optional<at::ScalarType> dtype) {
  const at::ScalarType out = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(out == at::kHalf || out == at::kBFloat16 || out == at::kFloat || out == at::kDouble, "posenc: sinusoidal_table: expected dtype to be "
                   "float16, bfloat16, float32 or float64, got ", out);
  // The op returns float64; one rounding to `out` here (add_position_checks.h says why).
  return ops::sinusoidal_table_op().call(positions, c10::SymInt(d_model), base).to(out);
}

at::Tensor add_position(const at::Tensor& x, const at::Tensor& table,
                        const std::optional<at::Tensor>& positions, int64_t offset,
                        bool batch_first, double p) {
  return ops::add_position_op().call(x, table, positions, c10::SymInt(offset), batch_first, p);
}

}  // namespace posenc
