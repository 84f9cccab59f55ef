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

#include "posenc/rope.h"

namespace posenc {

struct RopeAppendKvOptions {
  // The cache lengths so far: token s of batch row b goes to cache row offset + offsets[b] + s
  // ("bshd", "bhsd") and turns at that position unless positions are given. For "thd", the
  // int offset is added to the default positions (0 .. tokens-1).
  TORCH_ARG(int64_t, offset) = 0;
  TORCH_ARG(std::optional<torch::Tensor>, offsets) = std::nullopt;
  // The positions the new tokens turn at (as ApplyRopeOptions'); default: their cache rows.
  TORCH_ARG(std::optional<torch::Tensor>, positions) = std::nullopt;
  // "thd" (paged cache) only: int64 (tokens,), slot = block * block_size + index; -1: rotate
  // but write nothing.
  TORCH_ARG(std::optional<torch::Tensor>, slot_mapping) = std::nullopt;
  // "bshd": q, k, v (batch, seq, heads, head_dim), caches (batch, max_len, kv_heads,
  // head_dim); "bhsd": (batch, heads, seq, head_dim), caches (batch, kv_heads, max_len,
  // head_dim) (Hugging Face's static cache); "thd": (tokens, heads, head_dim), caches
  // (num_blocks, block_size, kv_heads, head_dim).
  TORCH_ARG(std::string, layout) = "bshd";
  TORCH_ARG(double, base) = 10000.0;
  TORCH_ARG(bool, interleaved) = false;
  TORCH_ARG(std::optional<int64_t>, rotary_dim) = std::nullopt;
  TORCH_ARG(RopeScaling, scaling) = {};
  TORCH_ARG(std::vector<int64_t>, sections) = {};
  TORCH_ARG(std::string, sections_mode) = "axial";
  // Also return the rotated k.
  TORCH_ARG(bool, return_k) = false;
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
