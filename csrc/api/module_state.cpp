// posenc's modules' torch::load (module_state.h).
#include "module_state.h"

#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace posenc {
namespace detail {
namespace {

// A module tensor and what the archive holds for it.
struct Pending {
  torch::Tensor held, stored;
};

// Reads every parameter and buffer of `module` and its children from `archive` (LibTorch's
// Module::load order and keys), checking each against the module's tensor, naming it by its
// path from the module load was called on (q_norm.weight); nothing is written.
void read_archive(torch::nn::Module& module, torch::serialize::InputArchive& archive, const std::string& prefix,
                  const std::string& top, std::vector<Pending>& out) {
  auto read = [&](const std::string& key, const torch::Tensor& held, bool is_buffer) {
    if (!held.defined()) return;
    torch::Tensor stored;  // undefined: try_read hands over the archive's tensor as it is
    TORCH_CHECK(archive.try_read(key, stored, is_buffer) && stored.defined(), "posenc: error loading ", top,
                ": no tensor ", prefix, key, " in the archive");
    TORCH_CHECK(stored.sizes() == held.sizes(), "posenc: error loading ", top, ": size mismatch for ", prefix,
                key, ": copying a tensor with shape ", stored.sizes(), " from the archive, the shape in the module is ",
                held.sizes(), " (build the module with the options it was saved with)");
    TORCH_CHECK_TYPE(!stored.is_complex() || held.is_complex(), "posenc: error loading ", top, ": ", prefix, key,
                     " is complex (", stored.scalar_type(), ") in the archive and real (", held.scalar_type(),
                     ") in the module: copying would drop its imaginary part");
    TORCH_CHECK(!stored.is_meta() || held.is_meta(), "posenc: error loading ", top, ": ", prefix, key,
                " is on the meta device in the archive (no data) and on ", held.device(), " in the module");
    out.push_back({held, stored});
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false)) read(item.key(), item.value(), false);
  for (const auto& item : module.named_buffers(/*recurse=*/false)) read(item.key(), item.value(), true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::InputArchive sub;
    TORCH_CHECK(archive.try_read(child.key(), sub), "posenc: error loading ", top, ": no submodule ", prefix,
                child.key(), " in the archive");
    read_archive(*child.value(), sub, prefix + child.key() + ".", top, out);
  }
  // What the module does not hold is refused, as Python's strict load_state_dict refuses
  // unexpected keys (another module's archive: a LearnedPositionalEncoding's table loaded
  // into a RotaryPositionalEncoding without a word).
  for (const auto& key : archive.keys()) {
    TORCH_CHECK(module.named_parameters(/*recurse=*/false).contains(key) ||
                    module.named_buffers(/*recurse=*/false).contains(key) || module.named_children().contains(key),
                "posenc: error loading ", top, ": unexpected tensor or submodule ", prefix, key,
                " in the archive (an archive of another module?)");
  }
}

}  // namespace

void load_same_shapes(torch::nn::Module& module, torch::serialize::InputArchive& archive) {
  std::vector<Pending> pending;
  read_archive(module, archive, "", module.name(), pending);
  // Then the values, cast to each tensor's dtype (LibTorch's load set_ the module's tensor
  // to the archive's storage: an archive of another dtype was read as the module's dtype's
  // bytes, a float64 table loaded into a float32 module as garbage). On the same device they
  // are copied into the tensor's own storage, as Python's load_state_dict does (aliases and
  // the registry keep seeing it); on another they move the tensor to the archive's device,
  // as LibTorch's load does (torch::load(module, path, device) moves the whole model).
  // requires_grad is kept either way.
  torch::NoGradGuard no_grad;
  for (auto& [held, stored] : pending) {
    if (held.device() == stored.device() || held.is_meta()) {  // a meta module has nothing to write
      held.copy_(stored);
    } else {
      held.set_data(stored.to(held.scalar_type()));
    }
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
