// posenc/add_position.h: posenc::add_position and the modules PositionalEncoding and
// LearnedPositionalEncoding. They call the ops through the dispatcher.
#include "posenc/add_position.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <cmath>

#include "module_state.h"
#include "ops/common/op_handles.h"
#include "posenc/sinusoidal_table.h"

namespace posenc {

at::Tensor add_position(const at::Tensor& x, const at::Tensor& table,
                        const std::optional<at::Tensor>& positions, int64_t offset,
                        bool batch_first, double p) {
  return ops::add_position_op().call(x, table, ops::optional_tensor(positions), c10::SymInt(offset), batch_first,
                                     p);
}

namespace {

// The forward shared by the add-position modules: dropout(x + pe[rows]) through the fused
// op; checks CUDA positions on the host first when asked (one device sync), since the
// kernel's check is a device-side assert, a RuntimeError at the next sync that leaves the
// CUDA context unusable; an IndexError here does not.
torch::Tensor add_position_module_forward(const torch::Tensor& x, const torch::Tensor& pe,
                                          int64_t offset,
                                          const std::optional<torch::Tensor>& given,
                                          bool batch_first, double p, bool check_positions) {
  const std::optional<torch::Tensor> positions = ops::optional_tensor(given);  // undefined: none
  // CUDA int64 positions: one read-back of their bounds (op position_bounds, shared with
  // the Python modules). CPU ones are checked in the kernel; other dtypes get the op's
  // TypeError.
  if (positions.has_value() && check_positions && positions->is_cuda() &&
      positions->scalar_type() == at::kLong) {
    ops::position_bounds_op().call(*positions, pe.size(1));
  }
  return add_position(x, pe, positions, offset, batch_first, p);
}

void check_dropout_option(const char* module, double dropout) {
  TORCH_CHECK_VALUE(dropout >= 0.0 && dropout <= 1.0, module, ": expected dropout in [0, 1], got ",
                    dropout);
}

void check_module_options(const char* module, int64_t d_model, int64_t max_len, double dropout) {
  TORCH_CHECK_VALUE(d_model > 0, module, ": expected d_model > 0, got ", d_model);
  TORCH_CHECK_VALUE(max_len > 0, module, ": expected max_len > 0, got ", max_len);
  check_dropout_option(module, dropout);
}

// The dropout probability of a call: options.dropout() as it is now (read at each call, as
// Python's module.dropout.p), checked in eval mode too (as nn.Dropout checks p), 0 in eval.
double call_dropout(const char* module, double dropout, bool training) {
  check_dropout_option(module, dropout);
  return training ? dropout : 0.0;
}

}  // namespace

PositionalEncodingImpl::PositionalEncodingImpl(const PositionalEncodingOptions& options_)
    : options(options_) {
  reset();
}

void PositionalEncodingImpl::reset() {
  check_module_options("PositionalEncoding", options.d_model(), options.max_len(),
                       options.dropout());
  const torch::Tensor positions = torch::arange(options.max_len(), torch::kLong);
  // float64 on the CPU, rounded once to the buffer's dtype: the default dtype when it is
  // registered (as Python's module), the module's own on a later reset() (a float64 module
  // gets the float64 table, not float32 values widened).
  torch::Tensor table =
      sinusoidal_table(positions, options.d_model(), options.base(), torch::kDouble).unsqueeze(0);
  if (!named_buffers(/*recurse=*/false).contains("pe")) {
    table = table.to(c10::typeMetaToScalarType(torch::get_default_dtype()));
  }
  // A second reset() (options edited) replaces the buffer's data; clone()'s reset() registers
  // a new buffer and leaves the original's alone.
  detail::register_or_replace(*this, "pe", pe, table, /*buffer=*/true);
}

void PositionalEncodingImpl::load(torch::serialize::InputArchive& archive) {
  detail::load_same_shapes(*this, archive);
}

void PositionalEncodingImpl::pretty_print(std::ostream& stream) const {
  stream << "posenc::PositionalEncoding(d_model=" << options.d_model()
         << ", dropout=" << options.dropout() << ", max_len=" << options.max_len()
         << ", batch_first=" << (options.batch_first() ? "true" : "false")
         << ", base=" << options.base() << ")";
}

torch::Tensor PositionalEncodingImpl::forward(const torch::Tensor& x, int64_t offset,
                                              const std::optional<torch::Tensor>& positions) {
  return add_position_module_forward(x, pe, offset, positions, options.batch_first(),
                                     call_dropout("PositionalEncoding", options.dropout(), is_training()),
                                     options.check_positions());
}

LearnedPositionalEncodingImpl::LearnedPositionalEncodingImpl(
    const LearnedPositionalEncodingOptions& options_)
    : options(options_) {
  reset();
}

void LearnedPositionalEncodingImpl::reset() {
  check_module_options("LearnedPositionalEncoding", options.d_model(),
                       options.max_len(), options.dropout());
  TORCH_CHECK_VALUE(options.init_std() >= 0.0 && std::isfinite(options.init_std()),
                    "LearnedPositionalEncoding: expected init_std to be finite and >= 0, got ",
                    options.init_std());
  padding_row(options.max_len());  // checked
  const torch::Tensor table = torch::empty({1, options.max_len(), options.d_model()});
  detail::register_or_replace(*this, "pe", pe, table, /*buffer=*/false);  // as above
  reset_parameters();
}

std::optional<int64_t> LearnedPositionalEncodingImpl::padding_row(int64_t rows) const {
  const auto p = options.padding_idx();
  if (!p) return std::nullopt;
  TORCH_CHECK_VALUE(*p >= -rows && *p < rows,
                    "LearnedPositionalEncoding: expected padding_idx in [-max_len, max_len) = [",
                    -rows, ", ", rows, "), got ", *p);
  return *p < 0 ? *p + rows : *p;  // as torch::nn::Embedding
}

void LearnedPositionalEncodingImpl::load(torch::serialize::InputArchive& archive) {
  detail::load_same_shapes(*this, archive);
}

void LearnedPositionalEncodingImpl::reset_parameters() {
  // Truncated normal on [-2 std, 2 std] by inverting the normal CDF of a uniform draw
  // between the CDF values of the cut points: Phi(+-2) = 0.5 * (1 + erf(+-2 / sqrt(2))).
  torch::NoGradGuard no_grad;
  const double std = options.init_std();
  const double hi = std::erf(2.0 / std::sqrt(2.0));  // 2 * Phi(2) - 1
  if (std == 0.0) {
    pe.zero_();  // +0 everywhere, as Python's zeros_ (the scaled draw left -0 on negative draws)
  } else {
    pe.uniform_(-hi, hi).erfinv_().mul_(std * std::sqrt(2.0)).clamp_(-2.0 * std, 2.0 * std);
  }
  if (const auto row = padding_row(pe.size(1))) pe.select(1, *row).zero_();
}

void LearnedPositionalEncodingImpl::pretty_print(std::ostream& stream) const {
  stream << "posenc::LearnedPositionalEncoding(d_model=" << options.d_model()
         << ", dropout=" << options.dropout() << ", max_len=" << options.max_len()
         << ", batch_first=" << (options.batch_first() ? "true" : "false")
         << ", init_std=" << options.init_std();
  // (the row padding_row reads, checked: an edit out of range is named here too)
  if (const auto row = padding_row(pe.size(1))) stream << ", padding_idx=" << *row;
  stream << ")";
}

torch::Tensor LearnedPositionalEncodingImpl::forward(
    const torch::Tensor& x, int64_t offset, const std::optional<torch::Tensor>& positions) {
  torch::Tensor table = pe;
  const std::optional<int64_t> padding = padding_row(pe.size(1));  // options as they are now
  if (padding && at::GradMode::is_enabled() && pe.requires_grad()) {
    // The same values, the padding row read detached: no gradient reaches it (as the
    // Python module; torch::nn::Embedding's padding_idx).
    const auto rows = torch::arange(pe.size(1), pe.options().dtype(torch::kLong));
    const auto keep = (rows != *padding).view({1, -1, 1});
    table = torch::where(keep, pe, pe.detach());
  }
  return add_position_module_forward(x, table, offset, positions, options.batch_first(),
                                     call_dropout("LearnedPositionalEncoding", options.dropout(), is_training()),
                                     options.check_positions());
}

void LearnedPositionalEncodingImpl::load_table(const torch::Tensor& table) {
  // pe's shape, not the options' (edited since reset() they would reshape the table's
  // values into pe's rows scrambled).
  const int64_t max_len = pe.size(1), d_model = pe.size(2);
  const bool ok = (table.dim() == 2 || (table.dim() == 3 && table.size(0) == 1)) &&
                  table.size(-2) == max_len && table.size(-1) == d_model;
  TORCH_CHECK_VALUE(ok, "LearnedPositionalEncoding::load_table: expected a table of shape (",
                    max_len, ", ", d_model, ") or (1, ", max_len, ", ", d_model, "), got ", table.sizes());
  // copy_ would drop a complex table's imaginary part (with a warning only), and a meta table
  // has no data to copy (a meta module loads one as a no-op), as the Python module refuses them.
  TORCH_CHECK_TYPE(!table.is_complex() && (!table.is_meta() || pe.is_meta()),
                   "LearnedPositionalEncoding::load_table: expected a real table that holds data, got dtype ",
                   table.scalar_type(), " on ", table.device());
  torch::NoGradGuard no_grad;
  pe.copy_(table.reshape(pe.sizes()));
}

}  // namespace posenc
