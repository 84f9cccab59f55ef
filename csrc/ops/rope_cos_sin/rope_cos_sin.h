// apply_rope_cos_sin: q (and k) rotated with given cos/sin tables (the calling convention of
// transformers' apply_rotary_pos_emb, Liger, FlashInfer and vLLM's cos-sin caches). The
// checks and the launch preparation shared by the CPU and CUDA kernels (rope_cos_sin.cpp;
// the autograd in autograd.cpp, the CUDA kernel in cuda/rope_cos_sin/rope_cos_sin.cu).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "ops/rope_cos_sin/cpu/kernel.h"  // RopeCosSinArgs (plain data)

namespace posenc {
namespace ops {

// Every argument check of the op (each error names the argument, its value and what was
// expected); works on Meta tensors. Returns true for layout "bhsd", false for "bshd".
bool check_rope_cos_sin(const at::Tensor& q, const std::optional<at::Tensor>& k,
                        const at::Tensor& cos, const at::Tensor& sin, const std::string& layout);

// A checked call ready for a kernel: the arguments, and the tables in the compute dtype that
// args.cos / args.sin point into (kept alive here).
struct RopeCosSinLaunch {
  RopeCosSinArgs args;
  at::Tensor cos, sin;
};

// out_q / out_k: where the kernel writes (q's and k's shapes, any dense strides).
RopeCosSinLaunch prepare_rope_cos_sin(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                      const at::Tensor& cos, const at::Tensor& sin, bool bhsd,
                                      bool interleaved, bool transpose, const at::Tensor& out_q,
                                      const std::optional<at::Tensor>& out_k);

}  // namespace ops
}  // namespace posenc
