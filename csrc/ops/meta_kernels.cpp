// Meta kernels: shapes and dtypes only, with symbolic sizes, so torch.compile and
// torch.export trace every posenc op without running it or breaking the graph.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/add_position_checks.h"
#include "ops/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

// The dispatcher picks the Meta kernel as soon as one tensor argument is a meta tensor, so a
// real first argument (x, grad, q: the one the outputs are made like) with a meta one
// among the others lands here too, and would get uninitialised real outputs back.
void check_not_mixed_with_meta(const char* op,
                               std::initializer_list<std::pair<const char*, const at::Tensor*>> args) {
  const auto& [first_name, first] = *args.begin();
  if (first->is_meta()) return;
  for (const auto& [name, t] : args) {
    TORCH_CHECK(t == nullptr || !t->defined() || !t->is_meta(), "posenc::", op, ": got ", name,
                " on the meta device but ", first_name, " on ", first->device(),
                "; pass the tensor arguments on one device (", first_name,
                " on meta for shape inference)");
  }
}

// The scalar checks of the real rope kernels (base, the int offset's domain).
void check_rope_meta_scalars(double base, const c10::SymInt& offset) {
  check_rope_base(base);
  if (const auto v = offset.maybe_as_int()) check_rope_position_value("offset", *v);
}

const at::Tensor* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? &*t : nullptr;
}

std::tuple<at::Tensor, at::Tensor> add_position_forward_meta(
    const at::Tensor& x, const at::Tensor& table, const std::optional<at::Tensor>& positions,
    c10::SymInt /*offset*/, bool batch_first, double p) {
  check_add_position_structure(x, table, positions, batch_first, p);
  check_not_mixed_with_meta("add_position_forward",
                            {{"x", &x}, {"table", &table}, {"positions", optional_ptr(positions)}});
  at::Tensor out = at::empty_symint(x.sym_sizes(), x.options());
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

at::Tensor sinusoidal_table_meta(const at::Tensor& positions, c10::SymInt d_model, double base,
                                 std::optional<at::ScalarType> dtype) {
  if (const auto d = d_model.maybe_as_int()) check_sinusoidal_table_args(positions, *d, base, dtype);
  std::vector<c10::SymInt> shape(positions.sym_sizes().begin(), positions.sym_sizes().end());
  shape.push_back(d_model);
  return at::empty_symint(shape, positions.options().dtype(dtype.value_or(at::kFloat)));
}

// rope: q's (and k's) shape and strides, as the backends allocate them (empty_like).
std::tuple<at::Tensor, at::Tensor> rope_meta(
    const at::Tensor& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
    c10::SymInt offset, const std::optional<at::Tensor>& cu_seqlens, double base,
    c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t /*seq_len*/,
    int64_t rotary_dim, bool /*interleaved*/, c10::string_view layout, bool /*inverse*/) {
  check_rope_structure(q, k, positions, offsets, cu_seqlens, rotary_dim, layout);
  check_not_mixed_with_meta("rope", {{"q", &q}, {"k", optional_ptr(k)}, {"positions", optional_ptr(positions)},
                                     {"offsets", optional_ptr(offsets)}, {"cu_seqlens", optional_ptr(cu_seqlens)}});
  parse_rope_scaling(rope_type, scaling);
  check_rope_meta_scalars(base, offset);
  return {at::empty_like(q), k.has_value() ? at::empty_like(*k) : at::empty({0}, q.options())};
}

void rope_inplace_meta(const at::Tensor& q, const std::optional<at::Tensor>& k,
                       const std::optional<at::Tensor>& positions,
                       const std::optional<at::Tensor>& offsets, c10::SymInt offset,
                       const std::optional<at::Tensor>& cu_seqlens, double base,
                       c10::string_view rope_type, at::ArrayRef<double> scaling,
                       int64_t /*seq_len*/, int64_t rotary_dim, bool /*interleaved*/,
                       c10::string_view layout, bool /*inverse*/) {
  check_rope_structure(q, k, positions, offsets, cu_seqlens, rotary_dim, layout);
  check_not_mixed_with_meta("rope_", {{"q", &q}, {"k", optional_ptr(k)}, {"positions", optional_ptr(positions)},
                                      {"offsets", optional_ptr(offsets)}, {"cu_seqlens", optional_ptr(cu_seqlens)}});
  parse_rope_scaling(rope_type, scaling);
  check_rope_meta_scalars(base, offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("rope", &rope_meta);
  m.impl("rope_", &rope_inplace_meta);
  m.impl("add_position_forward", &add_position_forward_meta);
  m.impl("add_position_backward", &add_position_backward_meta);
  m.impl("add_position_backward_with_table", &add_position_backward_with_table_meta);
  m.impl("sinusoidal_table", &sinusoidal_table_meta);
}

}  // namespace ops
}  // namespace posenc
