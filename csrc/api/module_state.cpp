// posenc's modules' torch::load (module_state.h).
#include "module_state.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>
#include <vector>

namespace posenc {
namespace detail {

void load_same_shapes(torch::nn::Module& module, torch::serialize::InputArchive& archive) {
  // The module's tensors, and aliases of them as they are now: the archive's reads replace a
  // tensor's storage and sizes in place (set_, or set_data across devices), which the alias
  // keeps, so the module can be put back as it was.
  std::vector<std::pair<std::string, torch::Tensor>> held;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) held.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) held.emplace_back(item.key(), item.value());
  std::vector<torch::Tensor> before;
  before.reserve(held.size());
  for (const auto& [name, tensor] : held) before.push_back(tensor.defined() ? tensor.detach() : tensor);
  auto restore = [&] {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < held.size(); ++i) {
      if (before[i].defined()) held[i].second.set_data(before[i]);
    }
  };
  try {
    module.torch::nn::Module::load(archive);
  } catch (...) {
    restore();
    throw;
  }
  for (size_t i = 0; i < held.size(); ++i) {
    const torch::Tensor& now = held[i].second;
    if (before[i].defined() && now.defined() && now.sizes() != before[i].sizes()) {
      const std::string shape_then = c10::str(before[i].sizes()), shape_now = c10::str(now.sizes());
      restore();
      TORCH_CHECK(false, "posenc: error loading ", module.name(), ": size mismatch for ", held[i].first,
                  ": copying a tensor with shape ", shape_now, " from the archive, the shape in the module is ",
                  shape_then, " (build the module with the options it was saved with)");
    }
  }
}

}  // namespace detail
}  // namespace posenc
