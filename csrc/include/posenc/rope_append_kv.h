// RoPE straight into a KV cache, for LibTorch applications that generate text: q and k rotated
// and the rotated k and v written into the cache in one pass (posenc::rope_append_kv /
// rope_append_kv_ ops), mirroring posenc.functional.rope_append_kv in Python. No autograd
// (inputs that require grad under grad mode are an error).
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "posenc/qk_norm_rope.h"
#include "posenc/rope.h"

namespace posenc {

struct RopeAppendKvOptions {
  // Every RoPE option, as apply_rope takes them (one declaration: ApplyRopeOptions). Here
  // offset and offsets are the cache lengths so far: token s of batch row b goes to cache
  // row offset + offsets[b] + s ("bshd", "bhsd") and turns at that position unless positions
  // are given; for "thd" the int offset is added to the default positions (0 .. tokens-1),
  // and must be 0 beside positions.
  // Layouts: "bshd": q, k, v (batch, seq, heads, head_dim), caches (batch, max_len, kv_heads,
  // head_dim); "bhsd": (batch, heads, seq, head_dim), caches (batch, kv_heads, max_len,
  // head_dim) (Hugging Face's static cache); "thd": (tokens, heads, head_dim), caches
  // (num_blocks, block_size, kv_heads, head_dim).
  TORCH_ARG(ApplyRopeOptions, rope) = {};
  // "thd" (paged cache) only: int64 (tokens,), slot = block * block_size + index; -1: rotate
  // but write nothing.
  TORCH_ARG(std::optional<torch::Tensor>, slot_mapping) = std::nullopt;
  // Also return the rotated k.
  TORCH_ARG(bool, return_k) = false;
  // FP8 caches (torch::kFloat8_e4m3fn, torch::kFloat8_e5m2) only: each cache's per-tensor
  // scale, a 0-d or 1-element float32 tensor on the CPU or on the cache's device (default 1).
  // The cache holds the float32 rotation divided by the scale, saturated to the format's
  // largest finite value and rounded to nearest even. k_scale(0.5) makes the tensor.
  TORCH_ARG(std::optional<torch::Tensor>, k_scale) = std::nullopt;
  TORCH_ARG(std::optional<torch::Tensor>, v_scale) = std::nullopt;
  // QK-norm before the rotation (Qwen3-style decoding): with q_weight and k_weight (as
  // qk_norm_rope takes them), q and k are normalised as qk_norm_rope does with eps,
  // weight_offset and norm (its defaults), then rotated; the cache holds qk_norm_rope's k.
  TORCH_ARG(std::optional<torch::Tensor>, q_weight) = std::nullopt;
  TORCH_ARG(std::optional<torch::Tensor>, k_weight) = std::nullopt;
  TORCH_ARG(double, eps) = QkNormRopeOptions().eps();
  TORCH_ARG(double, weight_offset) = QkNormRopeOptions().weight_offset();
  TORCH_ARG(std::string, norm) = QkNormRopeOptions().norm();

 public:
  RopeAppendKvOptions& k_scale(double scale);
  RopeAppendKvOptions& v_scale(double scale);
};

// Rotated q (a new tensor) and, with return_k, rotated k (else an empty tensor); k_cache and
// v_cache are written in place. A row or slot out of range is an IndexError on the CPU,
// raised before anything is written.
std::tuple<torch::Tensor, torch::Tensor> rope_append_kv(const torch::Tensor& q,
                                                        const torch::Tensor& k,
                                                        const torch::Tensor& v,
                                                        const torch::Tensor& k_cache,
                                                        const torch::Tensor& v_cache,
                                                        const RopeAppendKvOptions& options = {});
// The same with q (and k, with return_k) rotated in their own storage.
void rope_append_kv_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const RopeAppendKvOptions& options = {});

}  // namespace posenc
