#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "posenc/modules.h"
#include "posenc/ops.h"

namespace posenc {

namespace {

// Check CUDA positions on the host when asked: the kernel itself never reads out of
// bounds, but it can only flag bad rows with NaN, not raise.
void check_positions_on_host(const torch::Tensor& positions, int64_t max_len) {
  if (positions.numel() == 0 || !positions.is_cuda()) return;  // CPU kernels check themselves
  const auto lo = positions.min().item<int64_t>();
  const auto hi = positions.max().item<int64_t>();
  TORCH_CHECK_INDEX(lo >= 0 && hi < max_len, "posenc: expected positions in [0, max_len=",
                    max_len, "), got values from ", lo, " to ", hi);
}

}  // namespace

PositionalEncodingImpl::PositionalEncodingImpl(const PositionalEncodingOptions& options_)
    : options(options_) {
  reset();
}

void PositionalEncodingImpl::reset() {
  TORCH_CHECK_VALUE(options.d_model() > 0, "PositionalEncoding: expected d_model > 0, got ",
                    options.d_model());
  TORCH_CHECK_VALUE(options.max_len() > 0, "PositionalEncoding: expected max_len > 0, got ",
                    options.max_len());
  TORCH_CHECK_VALUE(options.dropout() >= 0.0 && options.dropout() <= 1.0,
                    "PositionalEncoding: expected dropout in [0, 1], got ", options.dropout());
  const torch::Tensor positions = torch::arange(options.max_len(), torch::kLong);
  pe = register_buffer(
      "pe", sinusoidal_table(positions, options.d_model(), options.base(), torch::kFloat)
                .unsqueeze(0));
}

void PositionalEncodingImpl::pretty_print(std::ostream& stream) const {
  stream << "posenc::PositionalEncoding(d_model=" << options.d_model()
         << ", dropout=" << options.dropout() << ", max_len=" << options.max_len()
         << ", batch_first=" << (options.batch_first() ? "true" : "false")
         << ", base=" << options.base() << ")";
}

torch::Tensor PositionalEncodingImpl::forward(const torch::Tensor& x, int64_t offset,
                                              const std::optional<torch::Tensor>& positions) {
  if (positions.has_value() && options.check_positions()) {
    check_positions_on_host(*positions, pe.size(1));
  }
  const double p = is_training() ? options.dropout() : 0.0;
  return add_position(x, pe, positions, offset, options.batch_first(), p);
}

}  // namespace posenc
