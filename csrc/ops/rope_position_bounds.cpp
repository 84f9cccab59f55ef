// posenc::rope_position_bounds: the smallest and largest position a RoPE call rotates.
// One definition serves three readers that used to compute it apart: the rope op itself
// ("dynamic" scaling needs the longest position), and the Python and C++
// RotaryPositionalEncoding modules (their [0, max_len) range check). The bounds are exact
// (per token: positions + per-row offset + offset, empty packed sequences skipped), computed
// on the index tensors' device and read back once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "ops/rope_checks.h"

namespace posenc {
namespace ops {

void check_rope_position_value(const char* what, int64_t value) {
  TORCH_CHECK_VALUE(value >= -kRopeMaxPosition && value <= kRopeMaxPosition, "posenc: expected ",
                    what, " within [-2**53, 2**53] (integers exact in the float64 angle), got ",
                    value);
}

std::tuple<int64_t, int64_t> rope_position_bounds_unchecked(
    const at::Tensor& q, const std::optional<at::Tensor>& positions,
    const std::optional<at::Tensor>& offsets, int64_t offset,
    const std::optional<at::Tensor>& cu_seqlens, RopeLayout layout) {
  const std::tuple<int64_t, int64_t> none{0, -1};
  check_rope_position_value("offset", offset);
  const at::Tensor qv = rope_canonical_view(q, layout);
  const int64_t batch = qv.size(0);
  const int64_t seq = qv.size(1);  // tokens for 'thd'
  if (batch == 0 || seq == 0) return none;
  if (!positions.has_value() && !offsets.has_value() && !cu_seqlens.has_value()) {
    return {offset, offset + seq - 1};
  }
  at::Tensor lo, hi;  // 0-d int64 tensors on the index tensors' device
  // The operands' own extremes are read back too (same transfer) and checked before any
  // sum of them is trusted: a sum of huge values could have wrapped around.
  std::vector<at::Tensor> extremes;
  std::vector<const char*> names;
  at::Tensor cu_summary;  // (cu_seqlens[0], cu_seqlens[-1], shortest length) for 'thd'
  auto add_extremes = [&](const char* name, const at::Tensor& t) {
    if (t.numel() == 0) return;
    auto [mn, mx] = at::aminmax(t.to(at::kLong));
    extremes.insert(extremes.end(), {mn, mx});
    names.insert(names.end(), {name, name});
  };
  if (positions.has_value()) add_extremes("positions", *positions);
  if (offsets.has_value()) add_extremes("offsets", *offsets);
  if (cu_seqlens.has_value()) {
    // Sequence i holds positions first[i] .. first[i] + length[i] - 1; empty ones none.
    // The values of cu_seqlens are checked here too (they are read anyway), so that a bad
    // one gets its own message rather than a range error about the positions it implies.
    TORCH_CHECK_VALUE(cu_seqlens->size(0) >= 2, "posenc: expected cu_seqlens to start at 0, ",
                      "never decrease and end at the number of tokens ", seq, ", got ",
                      cu_seqlens->size(0), " value(s) for ", seq, " tokens");
    const at::Tensor cu = cu_seqlens->to(at::kLong);
    const at::Tensor lengths = cu.slice(0, 1) - cu.slice(0, 0, -1);
    cu_summary = at::stack({cu[0], cu[-1], lengths.min()});
    const at::Tensor first = offsets.has_value() ? *offsets : at::zeros_like(lengths);
    const at::Tensor nonempty = lengths > 0;
    lo = at::where(nonempty, first, std::numeric_limits<int64_t>::max()).min();
    hi = at::where(nonempty, first + lengths - 1, std::numeric_limits<int64_t>::min()).max();
  } else {
    at::Tensor pos = positions.has_value() ? positions->reshape({-1, seq})
                                           : at::arange(seq, offsets->options()).unsqueeze(0);
    if (offsets.has_value()) pos = pos + offsets->unsqueeze(1);
    std::tie(lo, hi) = at::aminmax(pos);
  }
  extremes.insert(extremes.begin(), {lo, hi});
  const size_t n_extremes = extremes.size();
  if (cu_summary.defined()) extremes.push_back(cu_summary);
  const at::Tensor all = at::cat(
      c10::fmap(extremes, [](const at::Tensor& t) { return t.reshape({-1}); })).to(at::kCPU);  // the one read back
  const int64_t* v = all.const_data_ptr<int64_t>();
  if (cu_summary.defined()) {
    const int64_t* c = v + n_extremes;
    TORCH_CHECK_VALUE(c[0] == 0 && c[1] == seq && c[2] >= 0, "posenc: expected cu_seqlens to ",
                      "start at 0, never decrease and end at the number of tokens ", seq,
                      ", got first value ", c[0], ", last value ", c[1], ", shortest step ", c[2]);
  }
  for (size_t i = 2; i < n_extremes; ++i) check_rope_position_value(names[i - 2], v[i]);
  if (v[1] < v[0]) return none;
  return {v[0] + offset, v[1] + offset};
}

namespace {

std::tuple<int64_t, int64_t> rope_position_bounds(const at::Tensor& q,
                                                  const std::optional<at::Tensor>& positions,
                                                  const std::optional<at::Tensor>& offsets,
                                                  int64_t offset,
                                                  const std::optional<at::Tensor>& cu_seqlens,
                                                  c10::string_view layout) {
  const RopeLayout parsed = check_rope_q(q, layout);
  check_rope_indices(q, positions, offsets, cu_seqlens, layout);
  return rope_position_bounds_unchecked(q, positions, offsets, offset, cu_seqlens, parsed);
}

}  // namespace

// Composed of ATen ops, so one kernel serves every backend. It reads values, so it has no
// Meta form: the modules skip their range check under torch.compile.
TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("rope_position_bounds", &rope_position_bounds);
}

}  // namespace ops
}  // namespace posenc
