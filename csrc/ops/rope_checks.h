// Argument validation and preparation for the rope ops, shared by the CPU, CUDA and Meta
// kernels so that every backend rejects the same inputs with the same message.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>

#include "ops/rope_args.h"
#include "posenc/math/rope.h"

namespace posenc {
namespace ops {

enum class RopeLayout { kBSHD, kBHSD, kSBHD, kTHD };

// "bshd", "bhsd", "sbhd" or "thd"; anything else raises ValueError listing these.
RopeLayout parse_rope_layout(c10::string_view layout);

// rope_type plus the float[] of the op (math::kRopeScalingFields values, NaN = not given,
// or an empty list for "default"). Raises ValueError naming a missing or invalid key.
math::RopeScaling parse_rope_scaling(c10::string_view rope_type, at::ArrayRef<double> fields);

// The tensor seen as (batch, seq, heads, head_dim): a view, no copy.
at::Tensor rope_canonical_view(const at::Tensor& x, RopeLayout layout);

// q's rank for the layout and its dtype; returns the parsed layout. Works on Meta tensors.
RopeLayout check_rope_q(const at::Tensor& q, c10::string_view layout);

// The index arguments against q (a checked q): 'thd' needs cu_seqlens and no positions,
// others no cu_seqlens; dtypes, devices and shapes of positions, offsets and cu_seqlens.
// Works on Meta tensors.
void check_rope_indices(const at::Tensor& q, const std::optional<at::Tensor>& positions,
                        const std::optional<at::Tensor>& offsets,
                        const std::optional<at::Tensor>& cu_seqlens, c10::string_view layout);

// Positions, offsets and the int offset must each lie in [-2**53, 2**53]: sums of three of
// them cannot overflow int64, and a summed position within +-2**53 is exact in the float64
// angle (beyond, up to 3 * 2**53, it rounds to a neighbouring even integer). ValueError
// naming `what` otherwise.
void check_rope_base(double base);

constexpr int64_t kRopeMaxPosition = int64_t{1} << 53;
void check_rope_position_value(const char* what, int64_t value);

// The (smallest, largest) position a call with these (checked) arguments rotates, exactly:
// position = positions[b, s] (or s) + offsets[b] + offset, per token of a packed sequence in
// 'thd'; (0, -1) when the call rotates no token. One read back to the host when an index
// tensor is given (a device sync for CUDA tensors), none otherwise; the values read are
// checked with check_rope_position_value. The op posenc::rope_position_bounds
// (rope_position_bounds.cpp) is the checked form.
std::tuple<int64_t, int64_t> rope_position_bounds_unchecked(
    const at::Tensor& q, const std::optional<at::Tensor>& positions,
    const std::optional<at::Tensor>& offsets, int64_t offset,
    const std::optional<at::Tensor>& cu_seqlens, RopeLayout layout);

// Structure checks (shapes, dtypes, devices, rotary_dim); work on Meta tensors. Returns the
// resolved rotary_dim (-1 means head_dim).
int64_t check_rope_structure(const at::Tensor& q, const std::optional<at::Tensor>& k,
                             const std::optional<at::Tensor>& positions,
                             const std::optional<at::Tensor>& offsets,
                             const std::optional<at::Tensor>& cu_seqlens, int64_t rotary_dim,
                             c10::string_view layout);

// Everything a kernel launch needs, with the small index tensors it points into kept alive.
struct RopeLaunch {
  RopeArgs args;
  at::Tensor positions, offsets, cu_seqlens;  // contiguous int64 copies (or the originals)
};

// The body every backend shares, given the backend's kernel launcher and output allocator:
// checks, outputs (allocated like the inputs), preparation, launch. Returns (q, k) rotated,
// k an empty tensor when absent; the in-place form rotates q and k themselves. Inputs are
// checked once, before anything touches a device; the runner launches on q's device with
// q's dtype (the CUDA one sets the device guard itself).
using RopeKernelRunner = void (*)(const RopeLaunch& launch, const at::Tensor& q);
using RopeOutputAllocator = at::Tensor (*)(const at::Tensor& like);

std::tuple<at::Tensor, at::Tensor> rope_out_of_place(
    const at::Tensor& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
    int64_t offset, const std::optional<at::Tensor>& cu_seqlens, double base,
    c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
    int64_t rotary_dim, bool interleaved, c10::string_view layout, bool inverse,
    RopeOutputAllocator allocate, RopeKernelRunner run);

void rope_in_place(const at::Tensor& q, const std::optional<at::Tensor>& k,
                   const std::optional<at::Tensor>& positions,
                   const std::optional<at::Tensor>& offsets, int64_t offset,
                   const std::optional<at::Tensor>& cu_seqlens, double base,
                   c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
                   int64_t rotary_dim, bool interleaved, c10::string_view layout, bool inverse,
                   RopeKernelRunner run);

// In place: q and k must not overlap themselves or each other (slices of one fused qkv
// buffer are fine).
void check_rope_inplace(const at::Tensor& q, const std::optional<at::Tensor>& k,
                        c10::string_view layout);

// The frequencies and attention factor of a configuration, validated.
std::vector<double> rope_frequencies_host(int64_t rotary_dim, double base,
                                          const math::RopeScaling& scaling, int64_t seq_len);

}  // namespace ops
}  // namespace posenc
