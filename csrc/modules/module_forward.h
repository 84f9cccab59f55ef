// The forward shared by the add-position modules.
#pragma once

#include <torch/types.h>

#include <optional>

namespace posenc {
namespace detail {

// dropout(x + pe[rows]) through the fused op; checks CUDA positions on the host first when
// asked (one device sync), since the kernel can only flag bad rows with NaN.
torch::Tensor add_position_module_forward(const torch::Tensor& x, const torch::Tensor& pe,
                                          int64_t offset,
                                          const std::optional<torch::Tensor>& positions,
                                          bool batch_first, double p, bool check_positions);

void check_module_options(const char* module, int64_t d_model, int64_t max_len, double dropout);

}  // namespace detail
}  // namespace posenc
