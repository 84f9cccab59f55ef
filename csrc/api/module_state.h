// The C++ modules' archive loading (torch::load), shared by the modules that hold tensors.
#pragma once

#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>

#include <string>

namespace posenc {
namespace detail {

// torch::nn::Module::load as Python's load_state_dict: every tensor the module holds is read
// from the archive and checked before anything is written (a missing tensor, another shape:
// LibTorch's own load takes any shape, so a module built for max_len 32 held a 64-row table
// under options saying 32; a complex tensor into a real one), a c10::Error naming the tensor
// by its path from the module (q_norm.weight); then each is copied into the module's tensor,
// cast to its dtype (LibTorch's load reinterpreted an archive of another dtype), on the
// archive's device as LibTorch's load moves tensors (torch::load(module, path, device)).
void load_same_shapes(torch::nn::Module& module, torch::serialize::InputArchive& archive);

// reset()'s tensor `name` (a buffer when `buffer`, else a parameter): registered with value
// the first time (the constructor's reset(), or a clone's, whose registry clone() cleared:
// decided by the registry, not by `member`, which a clone shares with its original until
// then), its data replaced by value on a later reset(), on the tensor's device and in its
// dtype (register_buffer / register_parameter refuse a name twice).
void register_or_replace(torch::nn::Module& module, const std::string& name, torch::Tensor& member,
                         const torch::Tensor& value, bool buffer);

}  // namespace detail
}  // namespace posenc
