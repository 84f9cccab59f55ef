// What every Meta kernel checks before it makes shapes.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <utility>

namespace posenc {
namespace ops {

// The dispatcher picks the Meta kernel as soon as one tensor argument is a meta tensor, so a
// real first argument (x, grad, q: the one the outputs are made like) with a meta one
// among the others lands there too, and would get uninitialised real outputs back.
inline void check_not_mixed_with_meta(
    const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> args) {
  const auto& [first_name, first] = *args.begin();
  if (first->is_meta()) return;
  for (const auto& [name, t] : args) {
    TORCH_CHECK(t == nullptr || !t->defined() || !t->is_meta(), "posenc::", op, ": got ", name,
                " on the meta device but ", first_name, " on ", first->device(),
                "; pass the tensor arguments on one device (", first_name,
                " on meta for shape inference)");
  }
}

inline const at::Tensor* optional_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? &*t : nullptr;
}

}  // namespace ops
}  // namespace posenc
