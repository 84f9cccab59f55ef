// posenc's LibTorch modules (torch::nn style: Options + Impl + TORCH_MODULE holder).
#pragma once

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <ostream>

#include "posenc/add_position.h"  // PositionalEncoding, LearnedPositionalEncoding
#include "posenc/helpers.h"  // the Timesteps module

namespace posenc {

}  // namespace posenc
