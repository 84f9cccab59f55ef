// The add-position ops composed from torch ops, for backends without a fused kernel
// (CompositeExplicitAutograd, the ATen fallback: aten_fallback.h): add_position_forward,
// add_position_backward and add_position_backward_with_table; table_gradient_composite, the
// differentiable form autograd uses under create_graph (twice-differentiable add_position);
// and scatter_rows_into_table, the deterministic row sum both build on.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/library.h>

#include <limits>
#include <mutex>

#include "ops/add_position/add_position_checks.h"
#include "ops/add_position/add_position_composite.h"
#include "ops/common/aten_fallback.h"
#include "ops/common/op_handles.h"
#include "posenc/math/philox.h"

namespace posenc {
namespace ops {

// The masked gradient scattered into the table rows that were read, summed over the batch,
// in float32 (float64 for float64 grad). Deterministic: a reduction over the batch
// dimension, or index_put with accumulate, which is sort based on CUDA (index_add on the CPU).
at::Tensor table_gradient_composite(const at::Tensor& grad_x, const at::Tensor& positions,
                                    const c10::SymInt& offset, bool batch_first,
                                    const c10::SymInt& table_len) {
  const at::ScalarType acc = grad_x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (!positions.defined()) {
    // Rows offset .. offset + seq - 1, each read once per batch element.
    const at::Tensor summed = grad_x.sum({batch_first ? 0 : 1}, false, acc);
    const c10::SymInt seq = summed.sym_size(0);
    return at::constant_pad_nd_symint(summed, {0, 0, offset, table_len - offset - seq}, 0);
  }
  const at::Tensor rows = batch_first ? grad_x : grad_x.transpose(0, 1);  // (B, S, d)
  const at::Tensor pos =
      positions.dim() == 1
          ? positions.unsqueeze(0).expand_symint({rows.sym_size(0), rows.sym_size(1)})
          : positions;
  return scatter_rows_into_table(pos.reshape(-1),
                                 rows.reshape_symint({-1, rows.sym_size(2)}).to(acc), table_len);
}

at::Tensor scatter_rows_into_table(const at::Tensor& positions, const at::Tensor& rows,
                                   const c10::SymInt& table_len) {
  // Out-of-range positions go to a spare last row, dropped by the narrow: no sync, no assert.
  const at::Tensor inside = positions.ge(0).logical_and(positions.lt(c10::Scalar(table_len)));
  const at::Tensor safe = at::where(inside, positions, c10::Scalar(table_len));
  at::Tensor table = at::zeros_symint({table_len + 1, rows.sym_size(1)}, rows.options());
  if (rows.is_cpu()) {
    // CPU index_put_ accumulates in parallel, in no fixed order; index_add_ walks the rows in
    // order (the ATen fallback's table gradient is then bitwise repeatable, as the kernels').
    table.index_add_(0, safe, rows);
  } else {
    table.index_put_({safe}, rows, /*accumulate=*/true);
  }
  return table.narrow_symint(0, 0, table_len);
}

namespace {

at::ScalarType accumulate_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// keep ? scale : 0 in the accumulation dtype (scale rounded once to it, as the kernels do).
at::Tensor keep_factors(const at::Tensor& keep, double scale, at::ScalarType acc) {
  const auto options = keep.options().dtype(acc);
  return at::where(keep, at::scalar_tensor(scale, options), at::scalar_tensor(0.0, options));
}

// The kernels' forward: (x + table row) in float32 (float64 for float64 x), times the
// dropout factor, rounded once to x's dtype. The mask is posenc's Philox mask of a fresh key
// from the default CPU generator (the CPU kernel's draw, so a forced CPU fallback draws the
// CPU kernel's mask; on other devices it differs from what their kernels would draw). Positions
// outside [0, max_len) raise on the CPU, as the CPU kernel does, and give NaN rows elsewhere,
// as the CUDA kernel does (checking them would cost a device sync).
std::tuple<at::Tensor, at::Tensor> add_position_forward_composite(
    const at::Tensor& x_in, const at::Tensor& table_in, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, bool save_mask) {
  TORCH_CHECK_VALUE(!save_mask || x_in.device().is_cpu(), "posenc: add_position_forward: "
                    "save_mask=True (a saved dropout mask) is CPU-only; on ", x_in.device(),
                    " the backward regenerates the mask from rng");
  const AddPositionArgs g =
      check_add_position_inputs(x_in, table_in, positions, offset, batch_first, p);
  warn_aten_fallback("add_position", x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::ScalarType acc = accumulate_dtype(x);
  const at::Tensor table = table_as_matrix(table_in, x.scalar_type());
  // The rows read, (1 or batch, seq, d) in batch-first order; inside: which are in range.
  at::Tensor rows, inside;
  if (positions.has_value()) {
    const at::Tensor pos = positions->dim() == 1 ? positions->unsqueeze(0) : *positions;
    if (pos.is_cpu()) {
      check_positions_in_range_cpu(pos, g.table_len);
    } else {
      inside = pos.ge(0).logical_and(pos.lt(g.table_len)).unsqueeze(-1);
    }
    const at::Tensor safe = inside.defined() ? at::where(inside.squeeze(-1), pos, 0) : pos;
    rows = table.index_select(0, safe.reshape({-1})).view({pos.size(0), pos.size(1), g.d});
  } else {
    rows = table.narrow(0, offset, g.seq).unsqueeze(0);
  }
  if (!batch_first) {
    rows = rows.transpose(0, 1);
    if (inside.defined()) inside = inside.transpose(0, 1);
  }
  at::Tensor sum = x.to(acc) + rows.to(acc);
  if (inside.defined()) sum = at::where(inside, sum, std::numeric_limits<double>::quiet_NaN());
  at::Tensor rng = at::empty({p > 0.0 ? 2 : 0}, x.options().dtype(at::kLong));
  if (p > 0.0) {
    uint64_t seed;
    {
      auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
          std::nullopt, at::detail::getDefaultCPUGenerator());
      std::lock_guard<std::mutex> lock(gen->mutex_);
      seed = gen->random64();
    }
    const auto params = math::make_dropout_params(p);
    const at::Tensor keep = dropout_keep_composite(seed, 0, params.threshold, x.sizes(), x.device());
    sum = sum * keep_factors(keep, params.scale, acc);
    if (save_mask) {
      rng = pack_keep_bits_composite(keep);
    } else {
      rng = at::tensor({static_cast<int64_t>(seed), int64_t{0}}, at::kLong).to(x.device());
    }
  }
  return {sum.to(x.scalar_type()).contiguous(), rng};
}

// grad * mask * scale, rounded once to grad's dtype; the mask read from the saved bits or
// regenerated from the (seed, offset) key (read back to the host: one sync off the CPU).
at::Tensor add_position_backward_composite(const at::Tensor& grad_in, const at::Tensor& rng,
                                           double p) {
  check_dropout_backward_args(grad_in, rng, p);
  warn_aten_fallback("add_position_backward", grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  if (grad.numel() == 0) return at::empty_like(grad);
  const auto params = math::make_dropout_params(p);
  at::Tensor keep;
  if (rng.scalar_type() == at::kByte) {
    keep = unpack_keep_bits_composite(rng, grad.size(2));
  } else {
    const at::Tensor key = rng.to(at::kCPU).contiguous();
    keep = dropout_keep_composite(static_cast<uint64_t>(key.const_data_ptr<int64_t>()[0]),
                                  static_cast<uint64_t>(key.const_data_ptr<int64_t>()[1]),
                                  params.threshold, grad.sizes(), grad.device());
  }
  const at::ScalarType acc = accumulate_dtype(grad);
  return (grad.to(acc) * keep_factors(keep, params.scale, acc)).to(grad.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_composite(
    const at::Tensor& grad, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, bool batch_first, double p, c10::SymInt table_len, bool need_x) {
  // The checks of the fused kernels (offset range, rng, p, positions layout).
  check_add_position_backward_inputs_if_concrete(grad, rng, positions, offset, batch_first, p,
                                                 table_len);
  warn_aten_fallback("add_position_backward_with_table", grad.device());
  const at::Tensor masked = p > 0.0 ? add_position_backward_op().call(grad, rng, p) : grad;
  at::Tensor grad_table = table_gradient_composite(masked, positions.value_or(at::Tensor()),
                                                   offset, batch_first, table_len);
  at::Tensor grad_x = !need_x ? at::empty({0}, grad.options())
                              : (p > 0.0 ? masked : grad.clone(at::MemoryFormat::Contiguous));
  return {grad_x, grad_table};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("add_position_forward", &add_position_forward_composite);
  m.impl("add_position_backward", &add_position_backward_composite);
  m.impl("add_position_backward_with_table", &add_position_backward_with_table_composite);
}

}  // namespace ops
}  // namespace posenc
