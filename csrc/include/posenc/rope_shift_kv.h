// Re-rotating cached keys, for LibTorch applications that generate text: rotate the keys of a
// KV cache in place from the positions they were written at to new ones (context shifting,
// llama.cpp's K-shift; attention sinks, StreamingLLM; a cached segment re-used at another
// offset), through the posenc::rope_shift_kv_ op, mirroring posenc.functional.rope_shift_kv in
// Python. No autograd (inputs that require grad under grad mode are an error).
//
// Each row turns by the angle it must have minus the angle it has, pair by pair: the RoPE
// angle at to_positions (with to_seq_len) minus the one at from_positions (with
// from_seq_len), under one configuration (options.rope()). Exact for every scaling type, also
// where the frequencies depend on the length ("dynamic", "longrope"); the attention factor
// ("yarn", "longrope") is already in the cached keys and is not applied again.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>

#include "posenc/rope.h"

namespace posenc {

struct RopeShiftKvOptions {
  // The RoPE configuration the keys were written with (base, interleaved, rotary_dim,
  // scaling, layout, sections, sections_mode, rotary_offset), as apply_rope takes it; its
  // positions, offset(s), cu_seqlens, seq_len and inverse must stay unset (a ValueError
  // otherwise: the positions are the function's from/to arguments, the lengths
  // from_seq_len and to_seq_len). Layouts: "bshd": cache (batch, max_len, kv_heads,
  // head_dim); "bhsd": (batch, kv_heads, max_len, head_dim) (Hugging Face's static cache);
  // "thd": paged, (num_blocks, block_size, kv_heads, head_dim).
  TORCH_ARG(ApplyRopeOptions, rope) = {};
  // Contiguous caches: int64 (n,) or (batch, n), the cache rows turned (default 0 .. n-1),
  // each at most once per batch row.
  TORCH_ARG(std::optional<torch::Tensor>, rows) = std::nullopt;
  // Paged caches ("thd") only: int64 (n,), slot = block * block_size + index; -1: not turned.
  TORCH_ARG(std::optional<torch::Tensor>, slot_mapping) = std::nullopt;
  // FP8 caches (torch::kFloat8_e4m3fn, torch::kFloat8_e5m2) only: the per-tensor scale, a 0-d
  // or 1-element float32 tensor on the CPU or on the cache's device (default 1). Values are
  // dequantised (times the scale, float32), rotated, quantised back (divided, saturated,
  // rounded to nearest even). k_scale(0.5) makes the tensor.
  TORCH_ARG(std::optional<torch::Tensor>, k_scale) = std::nullopt;
  // The lengths "dynamic" and "longrope" scaled for at each end (the longest position + 1 of
  // the call that wrote the keys, and of the new positions); unset: the longest of each
  // end's positions + 1 (a device sync for device positions).
  TORCH_ARG(std::optional<int64_t>, from_seq_len) = std::nullopt;
  TORCH_ARG(std::optional<int64_t>, to_seq_len) = std::nullopt;

 public:
  RopeShiftKvOptions& k_scale(double scale);
};

// Rotates the listed rows of k_cache in place: from_positions and to_positions are int64
// (n,) or (batch, n) ((n,) for "thd"; with sections a leading axis of n_axes). A row or slot
// out of range is an IndexError on the CPU, one listed twice a ValueError, both raised before
// anything is written. Returns k_cache.
torch::Tensor rope_shift_kv_(const torch::Tensor& k_cache, const torch::Tensor& from_positions,
                             const torch::Tensor& to_positions, const RopeShiftKvOptions& options = {});

}  // namespace posenc
