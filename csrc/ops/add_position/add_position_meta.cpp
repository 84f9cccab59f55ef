// Meta kernels of the add-position ops (add_position_forward, add_position_backward,
// add_position_backward_with_table): shapes and dtypes only, with symbolic sizes, so
// torch.compile and torch.export trace them without running them or breaking the graph.
// Each op family has its own file here (RoPE's is rope/rope_meta.cpp).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/add_position/add_position_checks.h"
#include "ops/common/meta_support.h"

namespace posenc {
namespace ops {
namespace {

std::tuple<at::Tensor, at::Tensor> add_position_forward_meta(
    const at::Tensor& x, const at::Tensor& table, const std::optional<at::Tensor>& positions,
    c10::SymInt /*offset*/, bool batch_first, double p, bool save_mask) {
  check_add_position_structure(x, table, positions, batch_first, p);
  check_not_mixed_with_meta("add_position_forward",
                            {{"x", &x}, {"table", &table}, {"positions", optional_ptr(positions)}});
  at::Tensor out = at::empty_symint(x.sym_sizes(), x.options());
  if (save_mask && p > 0.0) {
    // The keep mask, 1 bit per element, rows padded to whole bytes (the CPU kernel's layout).
    at::Tensor mask = at::empty_symint({x.sym_size(0), x.sym_size(1), (x.sym_size(2) + 7) / 8},
                                       x.options().dtype(at::kByte));
    return {out, mask};
  }
  at::Tensor rng = at::empty({p > 0.0 ? 2 : 0}, x.options().dtype(at::kLong));
  return {out, rng};
}

at::Tensor add_position_backward_meta(const at::Tensor& grad, const at::Tensor& rng, double p) {
  check_not_mixed_with_meta("add_position_backward", {{"grad", &grad}, {"rng", &rng}});
  check_dropout_backward_args(grad, rng, p);
  return at::empty_symint(grad.sym_sizes(), grad.options());
}

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_meta(
    const at::Tensor& grad, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, bool batch_first, double p, c10::SymInt table_len, bool need_x) {
  check_not_mixed_with_meta("add_position_backward_with_table",
                            {{"grad", &grad}, {"rng", &rng}, {"positions", optional_ptr(positions)}});
  check_dropout_probability(p);
  check_add_position_backward_inputs_if_concrete(grad, rng, positions, offset, batch_first, p,
                                                 table_len);
  TORCH_CHECK_VALUE(table_len.maybe_as_int().value_or(0) >= 0,
                    "posenc: expected table_len >= 0, got ", table_len);
  TORCH_CHECK(grad.dim() == 3, "posenc: expected grad to be a 3-D tensor, got shape ",
              grad.sym_sizes());
  const at::ScalarType acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_x = need_x ? at::empty_symint(grad.sym_sizes(), grad.options())
                             : at::empty({0}, grad.options());
  at::Tensor grad_table =
      at::empty_symint({std::move(table_len), grad.sym_size(2)}, grad.options().dtype(acc));
  return {grad_x, grad_table};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("add_position_forward", &add_position_forward_meta);
  m.impl("add_position_backward", &add_position_backward_meta);
  m.impl("add_position_backward_with_table", &add_position_backward_with_table_meta);
}

}  // namespace ops
}  // namespace posenc
