// Rotary position embedding (RoPE) for LibTorch applications: the functional form and the
// RotaryPositionalEncoding module, mirroring posenc.functional.apply_rope and
// posenc.RotaryPositionalEncoding in Python. Both call the dispatcher ops posenc::rope and
// posenc::rope_, so they run on CPU or CUDA by the inputs' device and record gradients.
#pragma once

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_module_holder.h>
#include <torch/nn/modules/container/any_value.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "posenc/math/rope.h"

namespace posenc {

// Hugging Face's rope_scaling dict as a struct: rope_type is "default", "linear", "dynamic",
// "yarn", "llama3", "longrope" or "proportional"; a key left unset is "not given" (its default applies where
// it has one). A key set that the type does not read (POSENC_ROPE_TYPES' keys column) is a
// ValueError, not a scaling that silently does not happen: "default" reads no key (a key set
// beside it, rope_type left at its default, is not an unscaled RoPE). The keys are those of POSENC_ROPE_SCALING_KEYS and
// POSENC_ROPE_SCALING_LIST_KEYS (posenc/math/rope.h), the lists the op reads.
struct RopeScaling {
  std::string rope_type = "default";
  std::optional<double> factor;
  std::optional<double> low_freq_factor;
  std::optional<double> high_freq_factor;
  std::optional<double> original_max_position_embeddings;
  std::optional<double> beta_fast;
  std::optional<double> beta_slow;
  std::optional<double> attention_factor;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  std::optional<bool> truncate;
  // proportional (Gemma 4): the share of the head's pairs that turn. Other types do not take
  // it (a ValueError): a transformers config's partial_rotary_factor is rotary_dim there
  // (ApplyRopeOptions::rotary_dim = int(head_dim * factor)).
  std::optional<double> partial_rotary_factor;
  // longrope (Phi-3): one factor per rotary pair each; short_factor until the longest
  // position + 1 exceeds original_max_position_embeddings, long_factor beyond.
  std::vector<double> short_factor;
  std::vector<double> long_factor;

  // The op's `scaling` argument: the bitmask of the keys set (bit i: the i-th key above),
  // every key's value (0 for an unset one), then the lists (ValueError when they differ in
  // length). Whether a key is set is the std::optional's, never a value's.
  std::vector<double> values() const;
};

// The options that configure RoPE (beside where the tokens sit), declared once:
// ApplyRopeOptions and RotaryPositionalEncodingOptions both expand this list, with the plain
// settings of POSENC_ROPE_SETTINGS (posenc/math/rope.h). X(type, name, default):
//   base           the frequencies' base (rope_theta).
//   interleaved    adjacent pairs (GPT-J, Meta LLaMA) instead of halves (GPT-NeoX, HF
//                  rotate_half).
//   rotary_dim     rotate only rotary_dim features; default the rest of the head (from
//                  rotary_offset), or 2 * sum(sections) with sections.
//   scaling        Hugging Face's rope_scaling (RopeScaling).
//   layout         "bshd", "bhsd", "sbhd" or "thd".
//   sections       multi-axis RoPE: rotary pairs per position axis (summing to
//                  rotary_dim / 2); positions are then int64 (n_axes, seq) or (n_axes,
//                  batch, seq) ((n_axes, tokens) for "thd"), default 0 .. seq-1 on every
//                  axis.
//   sections_mode  "axial" (each section its own 1-D RoPE of width 2 * sections[a]: FLUX,
//                  EVA-02 / timm, torchtune vision), "mrope" (one frequency list, contiguous
//                  sections: Qwen2-VL) or "mrope_interleaved" (Qwen3-VL).
#define POSENC_ROPE_CONFIG_OPTIONS(X)                    \
  X(double, base, 10000.0)                               \
  X(bool, interleaved, false)                            \
  X(std::optional<int64_t>, rotary_dim, std::nullopt)    \
  X(RopeScaling, scaling, {})                            \
  X(std::string, layout, "bshd")                         \
  X(std::vector<int64_t>, sections, {})                  \
  X(std::string, sections_mode, "axial")

struct ApplyRopeOptions {
  // int64 (seq,) or (batch, seq); default 0 .. seq-1.
  TORCH_ARG(std::optional<torch::Tensor>, positions) = std::nullopt;
  // Added to every position.
  TORCH_ARG(int64_t, offset) = 0;
  // int64 (batch,) per-sequence offsets (KV-cache lengths), added too.
  TORCH_ARG(std::optional<torch::Tensor>, offsets) = std::nullopt;
  // Cumulative sequence lengths for layout "thd" (int32 or int64).
  TORCH_ARG(std::optional<torch::Tensor>, cu_seqlens) = std::nullopt;
  // "dynamic" / "longrope": the length they scale for (longest position + 1; the global one
  // for a shard of the sequence), >= 0; default the longest position of the call. Ignored
  // by the other types (Python's seq_len=).
  TORCH_ARG(std::optional<int64_t>, seq_len) = std::nullopt;
  // Rotate by minus each angle: the inverse rotation (RoPE's backward; DeepSeek V4 turns its
  // attention output back before the output projection). Its gradient is the forward rotation.
  TORCH_ARG(bool, inverse) = false;
  // The configuration (POSENC_ROPE_CONFIG_OPTIONS below) and the plain settings
  // (posenc/math/rope.h, POSENC_ROPE_SETTINGS).
#define POSENC_X(type, name, default_value, ...) TORCH_ARG(type, name) = default_value;
  POSENC_ROPE_CONFIG_OPTIONS(POSENC_X)
  POSENC_ROPE_SETTINGS(POSENC_X)
#undef POSENC_X
};

// Rotated copies of q and k (one fused launch); k may have fewer heads (GQA/MQA).
std::tuple<torch::Tensor, torch::Tensor> apply_rope(const torch::Tensor& q, const torch::Tensor& k,
                                                    const ApplyRopeOptions& options = {});
// One tensor.
torch::Tensor apply_rope(const torch::Tensor& q, const ApplyRopeOptions& options = {});
// In place (inference): q and k rotated in their own storage.
void apply_rope_(const torch::Tensor& q, const std::optional<torch::Tensor>& k,
                 const ApplyRopeOptions& options = {});

// (inv_freq float64 of rotary_dim / 2 pairs, attention factor) of a configuration; with
// sections, each pair's frequency as multi-axis RoPE computes it.
std::tuple<torch::Tensor, double> rope_frequencies(int64_t rotary_dim, double base = 10000.0,
                                                   const RopeScaling& scaling = {},
                                                   int64_t seq_len = 0,
                                                   const std::vector<int64_t>& sections = {},
                                                   const std::string& sections_mode = "axial");

// Positions of the patches of a grid (e.g. {h, w} patches of an image, {t, h, w} of a
// video) for multi-axis RoPE: int64 (grid.size(), num_prefix_tokens + prod(grid)), axis 0
// the slowest-varying coordinate, patches in row-major order after num_prefix_tokens prefix
// (class, register) tokens at position 0 on every axis, i.e. unrotated.
torch::Tensor rope_grid_positions(const std::vector<int64_t>& grid,
                                  int64_t num_prefix_tokens = 0,
                                  const torch::Device& device = torch::kCPU);

// q and k (k may be empty: undefined) rotated with given cos/sin tables, as transformers'
// apply_rotary_pos_emb: x * cos + rotate_half(x) * sin over the tables' width (the rest of
// head_dim passes through). layout "bhsd" (batch, heads, seq, head_dim) or "bshd"; tables
// (seq, rotary_dim) or (batch or 1, seq, rotary_dim), broadcast over heads; interleaved:
// adjacent pairs (GPT-J's rotate_every_two). One fused op (posenc::apply_rope_cos_sin) with
// autograd; returns (q rotated, k rotated or undefined).
std::tuple<torch::Tensor, torch::Tensor> apply_rope_cos_sin(const torch::Tensor& q,
                                                            const torch::Tensor& k,
                                                            const torch::Tensor& cos,
                                                            const torch::Tensor& sin,
                                                            const std::string& layout = "bhsd",
                                                            bool interleaved = false);

// Where a module call's tokens sit: the per-call position arguments of ApplyRopeOptions.
struct RopePositions {
  // int64 (seq,) or (batch, seq), (n_axes, ...) with sections; default 0 .. seq-1
  // (restarting per packed sequence).
  TORCH_ARG(std::optional<torch::Tensor>, positions) = std::nullopt;
  TORCH_ARG(int64_t, offset) = 0;
  // int64 per-row (or per packed sequence) offsets, added too.
  TORCH_ARG(std::optional<torch::Tensor>, offsets) = std::nullopt;
  // Cumulative sequence lengths for layout "thd".
  TORCH_ARG(std::optional<torch::Tensor>, cu_seqlens) = std::nullopt;
  // As ApplyRopeOptions::seq_len.
  TORCH_ARG(std::optional<int64_t>, seq_len) = std::nullopt;
};

struct RotaryPositionalEncodingOptions {
  /* implicit */ RotaryPositionalEncodingOptions(int64_t dim) : dim_(dim) {}
  // head_dim of q and k.
  TORCH_ARG(int64_t, dim);
  // Positions must lie in [0, max_len).
  TORCH_ARG(int64_t, max_len) = 4096;
  // The model's max_position_embeddings, which the scaling defaults come from (default:
  // max_len): "yarn"'s original_max_position_embeddings, "longrope"'s factor
  // (max_position_embeddings / original_max_position_embeddings), as transformers fills them
  // from its config. Give it when max_len (the range check) is not the model's length: a
  // Phi-3 dict without factor would otherwise take its attention factor from max_len.
  TORCH_ARG(std::optional<int64_t>, max_position_embeddings) = std::nullopt;
  // As ApplyRopeOptions' (POSENC_ROPE_CONFIG_OPTIONS, POSENC_ROPE_SETTINGS). Scaling: "yarn"'s
  // original_max_position_embeddings and "longrope"'s factor default as above; "dynamic" needs
  // original_max_position_embeddings (given, or max_position_embeddings) below max_len (it rescales only positions
  // beyond it). Multi-axis RoPE: every coordinate must lie in [0, max_len).
#define POSENC_X(type, name, default_value, ...) TORCH_ARG(type, name) = default_value;
  POSENC_ROPE_CONFIG_OPTIONS(POSENC_X)
  POSENC_ROPE_SETTINGS(POSENC_X)
#undef POSENC_X
  // Range-check CUDA position tensors on the host (one device sync).
  TORCH_ARG(bool, check_positions) = true;
};

namespace detail {
struct ParsedRope;  // the options as the op reads them (api/rope.cpp)
}  // namespace detail

// RoPE as a module. It holds no parameters or buffers (the kernel evaluates the frequencies
// from the options), so it saves nothing; inv_freq() returns them for inspection. reset()
// (run by the constructor) parses and checks the options once, into the call every forward
// starts from: after changing `options`, call reset(), as for torch::nn's modules (until then
// forward, inv_freq() and attention_scaling() keep the parsed ones; check_positions, the
// range check's switch, is read at each call). clone() runs reset() on the copy, as
// LibTorch's Cloneable does: a clone parses the options as they are now.
class RotaryPositionalEncodingImpl : public torch::nn::Cloneable<RotaryPositionalEncodingImpl> {
 public:
  explicit RotaryPositionalEncodingImpl(const RotaryPositionalEncodingOptions& options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  // torch::load: the module holds no tensor; an archive that holds one (another module's) is
  // refused, as Python's strict load_state_dict refuses unexpected keys.
  void load(torch::serialize::InputArchive& archive) override;

  // Rotated (q, k); q alone with an undefined k (torch::Tensor()), the second output then
  // undefined. positions: int64 (seq,) or (batch, seq); offset: added to each position.
  // Every position must lie in [0, max_len) (IndexError otherwise; CUDA position tensors are
  // read back for that check unless check_positions is off).
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& q, const torch::Tensor& k,
      const std::optional<torch::Tensor>& positions = std::nullopt, int64_t offset = 0);
  // The same with per-row offsets (KV caches of different lengths) or, for layout "thd",
  // packed sequences. (A separate name: TORCH_MODULE's call operator needs one forward.)
  std::tuple<torch::Tensor, torch::Tensor> forward_at(const torch::Tensor& q,
                                                      const torch::Tensor& k,
                                                      const RopePositions& where);

  // The float64 inverse frequencies and the attention factor (yarn, longrope; 1 otherwise) of
  // the options reset() parsed: what forward rotates with.
  torch::Tensor inv_freq() const;
  double attention_scaling() const;

  RotaryPositionalEncodingOptions options;

 protected:
  // The defaults for torch::nn::AnyModule, which calls forward(q, k).
  FORWARD_HAS_DEFAULT_ARGS({2, torch::nn::AnyValue(std::optional<torch::Tensor>())},
                           {3, torch::nn::AnyValue(int64_t{0})})

 private:
  // rotary_dim, or 2 * sum(sections), or dim.
  int64_t rotary_width() const;
  // Set by reset(); immutable, so clones share it.
  std::shared_ptr<const detail::ParsedRope> parsed_;
};

TORCH_MODULE(RotaryPositionalEncoding);

}  // namespace posenc
