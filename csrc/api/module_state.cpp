// posenc's modules' torch::load (module_state.h).
#include "module_state.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>
#include <vector>

namespace posenc {
namespace detail {
namespace {

// Throws when a tensor of the archive has another shape than the module's, naming it by its
// path from the module load was called on (q_norm.weight), before anything is written.
void check_archive_shapes(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                          const std::string& prefix, const std::string& top) {
  auto check = [&](const std::string& key, const torch::Tensor& held, bool is_buffer) {
    torch::Tensor stored;
    if (!held.defined() || !archive.try_read(key, stored, is_buffer) || !stored.defined()) return;
    TORCH_CHECK(stored.sizes() == held.sizes(), "posenc: error loading ", top, ": size mismatch for ", prefix,
                key, ": copying a tensor with shape ", stored.sizes(), " from the archive, the shape in the module is ",
                held.sizes(), " (build the module with the options it was saved with)");
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false)) check(item.key(), item.value(), false);
  for (const auto& item : module.named_buffers(/*recurse=*/false)) check(item.key(), item.value(), true);
  for (const auto& child : module.named_children()) {
    torch::serialize::InputArchive sub;
    if (archive.try_read(child.key(), sub)) check_archive_shapes(*child.value(), sub, prefix + child.key() + ".", top);
  }
}

}  // namespace

void load_same_shapes(torch::nn::Module& module, torch::serialize::InputArchive& archive) {
  check_archive_shapes(module, archive, "", module.name());
  // Then LibTorch's load; should it fail part way (a missing tensor), the module's tensors
  // are put back as they were: aliases keep their storage and sizes, which the archive's
  // reads replace in place (set_, or set_data across devices).
  std::vector<std::pair<torch::Tensor, torch::Tensor>> held;  // (the module's tensor, its alias)
  for (const auto& item : module.named_parameters(/*recurse=*/true)) held.emplace_back(item.value(), torch::Tensor());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) held.emplace_back(item.value(), torch::Tensor());
  for (auto& [tensor, alias] : held) {
    if (tensor.defined()) alias = tensor.detach();
  }
  try {
    module.torch::nn::Module::load(archive);
  } catch (...) {
    torch::NoGradGuard no_grad;
    for (auto& [tensor, alias] : held) {
      if (alias.defined()) tensor.set_data(alias);
    }
    throw;
  }
}

void register_or_replace(torch::nn::Module& module, const std::string& name, torch::Tensor& member,
                         const torch::Tensor& value, bool buffer) {
  const bool registered = buffer ? module.named_buffers(/*recurse=*/false).contains(name)
                                 : module.named_parameters(/*recurse=*/false).contains(name);
  if (registered) {
    torch::NoGradGuard no_grad;
    member.set_data(value.to(member.device(), member.scalar_type()));
  } else {
    member = buffer ? module.register_buffer(name, value) : module.register_parameter(name, value);
  }
}

}  // namespace detail
}  // namespace posenc
