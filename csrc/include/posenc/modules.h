// posenc's LibTorch modules (torch::nn style: Options + Impl + TORCH_MODULE holder), each
// declared in its family's header.
#pragma once

#include "posenc/add_position.h"  // PositionalEncoding, LearnedPositionalEncoding
#include "posenc/helpers.h"       // Timesteps
#include "posenc/qk_norm_rope.h"  // QKNormRotary
#include "posenc/rope.h"          // RotaryPositionalEncoding
