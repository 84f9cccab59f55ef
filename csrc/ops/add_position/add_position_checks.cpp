#include "ops/add_position/add_position_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/add_position/position_bounds.h"

namespace posenc {
namespace ops {

namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

const char* layout_name(bool batch_first) {
  return batch_first ? "(batch, seq, d_model) with batch_first=True"
                     : "(seq, batch, d_model) with batch_first=False";
}

// TypeError naming grad unless it has a dtype the kernels take.
void check_grad_dtype(const at::Tensor& grad) {
  TORCH_CHECK_TYPE(is_supported_float(grad.scalar_type()),
                   "posenc: expected grad to have a floating-point dtype (float16, bfloat16, "
                   "float32 or float64), got ", grad.scalar_type());
}

}  // namespace

void check_dropout_probability(double p) {
  TORCH_CHECK_VALUE(std::isfinite(p) && p >= 0.0 && p <= 1.0,
                    "posenc: expected dropout probability p in [0, 1], got ", p);
}

void check_dropout_state(const at::Tensor& grad, const at::Tensor& rng) {
  // sym_*: the Meta kernels run this too, where rng can have symbolic sizes.
  if (rng.scalar_type() == at::kByte) {
    TORCH_CHECK(grad.device().is_cpu() || grad.device().is_meta(),
                "posenc: a saved dropout mask (uint8 rng, add_position_forward with "
                "save_mask=True) is CPU-only; on ", grad.device(),
                " rng must be the int64 (seed, offset) pair");
    const bool ok = rng.device() == grad.device() && grad.dim() == 3 && rng.dim() == 3 &&
                    rng.sym_size(0) == grad.sym_size(0) && rng.sym_size(1) == grad.sym_size(1) &&
                    rng.sym_size(2) == (grad.sym_size(2) + 7) / 8;
    TORCH_CHECK(ok, "posenc: expected rng, the saved dropout mask (uint8), to have shape "
                "(grad.size(0), grad.size(1), ceil(grad.size(2) / 8)) on ", grad.device(),
                " for grad of shape ", grad.sym_sizes(), ", got shape ", rng.sym_sizes(), " on ",
                rng.device());
    return;
  }
  TORCH_CHECK(rng.device() == grad.device() && rng.sym_numel() == 2 &&
                  rng.scalar_type() == at::kLong,
              "posenc: expected rng to be the int64 (seed, offset) pair from the forward on ",
              grad.device(), ", got ", rng.scalar_type(), " of shape ", rng.sym_sizes(), " on ",
              rng.device());
}

void check_dropout_backward_args(const at::Tensor& grad, const at::Tensor& rng, double p) {
  check_dropout_state(grad, rng);
  check_dropout_probability(p);
  check_grad_dtype(grad);
}

void check_add_position_structure(const at::Tensor& x, const at::Tensor& table,
                                  const std::optional<at::Tensor>& positions,
                                  bool batch_first, double p) {
  TORCH_CHECK(x.dim() == 3, "posenc: expected x to be a 3-D tensor ", layout_name(batch_first),
              ", got a ", x.dim(), "-D tensor of shape ", x.sym_sizes());
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()),
                   "posenc: expected x to have a floating-point dtype (float16, bfloat16, "
                   "float32 or float64), got ",
                   x.scalar_type());
  TORCH_CHECK(table.dim() == 2 || (table.dim() == 3 && table.sym_size(0) == 1),
              "posenc: expected the position table to have shape (max_len, d_model) or "
              "(1, max_len, d_model), got shape ",
              table.sym_sizes());
  TORCH_CHECK_TYPE(is_supported_float(table.scalar_type()),
                   "posenc: expected the position table to have a floating-point dtype, got ",
                   table.scalar_type());
  TORCH_CHECK(x.device() == table.device(), "posenc: expected x and the position table on the ",
              "same device, got x on ", x.device(), " and the table on ", table.device(),
              " (move the module with .to(x.device))");
  TORCH_CHECK(x.sym_size(2) == table.sym_size(-1), "posenc: expected the last dimension of x ",
              "(d_model) to be ", table.sym_size(-1), " like the position table, got x of shape ",
              x.sym_sizes());
  check_dropout_probability(p);
  if (positions.has_value()) {
    const at::Tensor& pos = *positions;
    TORCH_CHECK_TYPE(pos.scalar_type() == at::kLong,
                     "posenc: expected positions to have dtype torch.int64, got ",
                     pos.scalar_type());
    TORCH_CHECK(pos.device() == x.device(), "posenc: expected positions on x's device ",
                x.device(), ", got positions on ", pos.device());
    const auto batch = x.sym_size(batch_first ? 0 : 1);
    const auto seq = x.sym_size(batch_first ? 1 : 0);
    const bool ok = (pos.dim() == 1 && pos.sym_size(0) == seq) ||
                    (pos.dim() == 2 && pos.sym_size(0) == batch && pos.sym_size(1) == seq);
    TORCH_CHECK(ok, "posenc: expected positions of shape (seq,) = (", seq, ",) or (batch, seq) = (",
                batch, ", ", seq, "), got shape ", pos.sym_sizes());
  }
}

namespace {

// Sizes, positions layout and the offset range, once the structure has been checked.
AddPositionArgs make_geometry(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                  int64_t offset, bool batch_first, int64_t table_len) {
  AddPositionArgs g;
  g.batch_first = batch_first;
  g.batch = x.size(batch_first ? 0 : 1);
  g.seq = x.size(batch_first ? 1 : 0);
  g.d = x.size(2);
  g.table_len = table_len;
  g.offset = offset;
  if (positions.has_value()) {
    TORCH_CHECK_VALUE(offset == 0, "posenc: pass either offset or positions, not both (got offset=",
                      offset, " with positions)");
    g.has_positions = true;
    g.positions_batch_stride = positions->dim() == 2 ? g.seq : 0;
  } else {
    TORCH_CHECK_VALUE(offset >= 0, "posenc: expected offset >= 0, got ", offset);
    // offset <= len - seq, not offset + seq <= len: a huge offset must not wrap around.
    TORCH_CHECK_VALUE(offset <= g.table_len - g.seq, "posenc: sequence length ", g.seq,
                      " plus offset ", offset, " exceeds max_len=", g.table_len,
                      " of the position table (build the encoding with a larger max_len)");
  }
  return g;
}

}  // namespace

AddPositionArgs check_add_position_inputs(const at::Tensor& x, const at::Tensor& table,
                                              const std::optional<at::Tensor>& positions,
                                              int64_t offset, bool batch_first, double p) {
  check_add_position_structure(x, table, positions, batch_first, p);
  return make_geometry(x, positions, offset, batch_first, table.size(-2));
}

AddPositionArgs check_add_position_backward_inputs(const at::Tensor& grad,
                                                       const at::Tensor& rng,
                                                       const std::optional<at::Tensor>& positions,
                                                       int64_t offset, bool batch_first, double p,
                                                       int64_t table_len) {
  TORCH_CHECK_VALUE(table_len >= 0, "posenc: expected table_len >= 0, got ", table_len);
  TORCH_CHECK(grad.dim() == 3, "posenc: expected grad to be a 3-D tensor, got shape ",
              grad.sizes());
  check_grad_dtype(grad);
  TORCH_CHECK_VALUE(table_len <= std::numeric_limits<int64_t>::max() / std::max<int64_t>(grad.size(2), 1),
                    "posenc: table_len ", table_len, " times d_model ", grad.size(2),
                    " overflows int64");
  // The structure checks of the forward, against a stand-in table on grad's device
  // (zero strides: it allocates one element, not a table).
  const at::Tensor table = at::empty_strided({table_len, grad.size(2)}, {0, 0}, grad.options());
  check_add_position_structure(grad, table, positions, batch_first, p);
  if (p > 0.0) check_dropout_state(grad, rng);
  return make_geometry(grad, positions, offset, batch_first, table_len);
}

void check_add_position_backward_inputs_if_concrete(const at::Tensor& grad, const at::Tensor& rng,
                                                     const std::optional<at::Tensor>& positions,
                                                     const c10::SymInt& offset, bool batch_first,
                                                     double p, const c10::SymInt& table_len) {
  // maybe_as_int, not is_heap_allocated: a SymInt stores ints near -2**63 on the heap too.
  const std::optional<int64_t> off = offset.maybe_as_int();
  const std::optional<int64_t> len = table_len.maybe_as_int();
  if (off.has_value() && len.has_value() &&
      !grad.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    check_add_position_backward_inputs(grad, rng, positions, *off, batch_first, p, *len);
  }
}

void check_positions_in_range_cpu(const at::Tensor& positions, int64_t table_len) {
  const at::Tensor pos = positions.contiguous();
  const int64_t* data = pos.const_data_ptr<int64_t>();
  const int64_t n = pos.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (data[i] < 0 || data[i] >= table_len) {
      throw_position_out_of_range(table_len, data[i], c10::str(" at flat index ", i));
    }
  }
}

at::Tensor table_as_matrix(const at::Tensor& table, at::ScalarType x_dtype) {
  at::Tensor t = table.dim() == 3 ? table.select(0, 0) : table;
  const at::ScalarType wide = x_dtype == at::kDouble ? at::kDouble : at::kFloat;
  if (t.scalar_type() != x_dtype && t.scalar_type() != wide) {
    t = t.to(wide);
  }
  return t.contiguous();
}

void check_sinusoidal_table_args(const at::Tensor& positions, int64_t d_model, double base) {
  TORCH_CHECK_VALUE(d_model > 0, "posenc: expected d_model > 0, got ", d_model);
  // base <= 1 would give every column the same or a growing frequency: no longer the
  // geometric ladder of wavelengths 2 pi .. 2 pi base (RoPE refuses the same values).
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 1.0,
                    "posenc: expected base to be a finite number > 1, got ", base);
  TORCH_CHECK_TYPE(!positions.is_complex() && positions.scalar_type() != at::kBool,
                   "posenc: expected integer or floating-point positions, got ",
                   positions.scalar_type());
}

}  // namespace ops
}  // namespace posenc
