// posenc::rope_position_bounds: the smallest and largest position a RoPE call rotates, over
// every axis. One definition serves three readers: the rope op itself ("dynamic" scaling
// needs the longest position), and the Python and C++ RotaryPositionalEncoding modules
// (their [0, max_len) range check). The bounds are exact (per token: positions + per-row
// offset + offset, empty packed sequences skipped), computed on the index tensors' device
// and read back once. posenc::rope_position_extremes: the same bounds left on the device
// (a traced module's range check, asserted there without a host sync).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "ops/common/rope_checks.h"
#include "ops/common/rope_launch.h"

namespace posenc {
namespace ops {

namespace {

// The extremes of a call's positions given by tensors, as 0-d int64 tensors on the index
// tensors' device (the int offset not added; hi < lo: no token), and what must be read
// with them to trust them: the operands' own extremes, cu_seqlens' summary.
struct TensorExtremes {
  at::Tensor lo, hi;
  std::vector<at::Tensor> operands;  // (min, max) of each index tensor, named in names
  std::vector<const char*> names;
  at::Tensor cu_summary;  // (cu_seqlens[0], cu_seqlens[-1], shortest length) for 'thd'
};

TensorExtremes tensor_extremes(const RopeCall& c, int64_t batch, int64_t seq) {
  TensorExtremes e;
  auto add_operand = [&](const char* name, const at::Tensor& t) {
    if (t.numel() == 0) return;
    auto [mn, mx] = at::aminmax(t.to(at::kLong));
    e.operands.insert(e.operands.end(), {mn, mx});
    e.names.insert(e.names.end(), {name, name});
  };
  if (c.positions.has_value()) add_operand("positions", *c.positions);
  if (c.offsets.has_value()) add_operand("offsets", *c.offsets);
  // Positions as (axes, rows, tokens), rows 1 when shared by the batch rows.
  const int64_t axes = c.n_axes();
  const at::Tensor pos = c.positions.has_value() ? c.positions->reshape({axes, -1, seq})
                                                 : at::Tensor();
  if (c.cu_seqlens.has_value()) {
    // The values of cu_seqlens are checked by the read-back too (they are read anyway), so
    // that a bad one gets its own message rather than a range error about the positions it
    // implies.
    TORCH_CHECK_VALUE(c.cu_seqlens->size(0) >= 2, "posenc: expected cu_seqlens to start at 0, ",
                      "never decrease and end at the number of tokens ", seq, ", got ",
                      c.cu_seqlens->size(0), " value(s) for ", seq, " tokens");
    const at::Tensor cu = c.cu_seqlens->to(at::kLong);
    const at::Tensor lengths = cu.slice(0, 1) - cu.slice(0, 0, -1);
    e.cu_summary = at::stack({cu[0], cu[-1], lengths.min()});
    const at::Tensor first = c.offsets.has_value() ? *c.offsets : at::zeros_like(lengths);
    if (pos.defined()) {
      // Multi-axis packed tokens: positions given per token, plus their sequence's offset.
      // Token t's sequence j has cu[j] <= t < cu[j + 1] (clamped: bad cu_seqlens values
      // are reported through cu_summary, with their own message).
      const at::Tensor tokens = at::arange(seq, cu.options());
      const at::Tensor j = at::searchsorted(cu.slice(0, 1), tokens, /*out_int32=*/false,
                                            /*right=*/true)
                               .clamp_max(lengths.size(0) - 1);
      const at::Tensor shift = first.index_select(0, j);
      std::tie(e.lo, e.hi) = at::aminmax(pos + shift);
    } else {
      // Sequence i holds positions first[i] .. first[i] + length[i] - 1; empty ones none.
      const at::Tensor nonempty = lengths > 0;
      e.lo = at::where(nonempty, first, std::numeric_limits<int64_t>::max()).min();
      e.hi = at::where(nonempty, first + lengths - 1, std::numeric_limits<int64_t>::min()).max();
    }
  } else {
    at::Tensor p = pos.defined() ? pos : at::arange(seq, c.offsets->options()).view({1, 1, seq});
    if (c.offsets.has_value()) p = p + c.offsets->view({1, batch, 1});
    std::tie(e.lo, e.hi) = at::aminmax(p);
  }
  return e;
}

bool has_index_tensors(const RopeCall& c) {
  return c.positions.has_value() || c.offsets.has_value() || c.cu_seqlens.has_value();
}

}  // namespace

std::tuple<int64_t, int64_t> rope_position_bounds_of(const RopeCall& c) {
  const std::tuple<int64_t, int64_t> none{0, -1};
  const int64_t offset = c.concrete_offset();  // domain-checked with the call's settings
  const at::Tensor qv = rope_canonical_view(c.q, c.layout);
  const int64_t batch = qv.size(0);
  const int64_t seq = qv.size(1);  // tokens for 'thd'
  if (batch == 0 || seq == 0) return none;
  if (!has_index_tensors(c)) return {offset, offset + seq - 1};
  // The operands' own extremes are read back too (same transfer) and checked before any
  // sum of them is trusted: a sum of huge values could have wrapped around.
  const TensorExtremes e = tensor_extremes(c, batch, seq);
  std::vector<at::Tensor> parts = {e.lo, e.hi};
  parts.insert(parts.end(), e.operands.begin(), e.operands.end());
  if (e.cu_summary.defined()) parts.push_back(e.cu_summary);
  const at::Tensor all = at::cat(c10::fmap(parts, [](const at::Tensor& t) {
                           return t.reshape({-1});
                         })).to(at::kCPU);  // the one read back
  const int64_t* v = all.const_data_ptr<int64_t>();
  const size_t n_extremes = 2 + e.operands.size();
  if (e.cu_summary.defined()) {
    const int64_t* s = v + n_extremes;
    TORCH_CHECK_VALUE(s[0] == 0 && s[1] == seq && s[2] >= 0, "posenc: expected cu_seqlens to ",
                      "start at 0, never decrease and end at the number of tokens ", seq,
                      ", got first value ", s[0], ", last value ", s[1], ", shortest step ", s[2]);
  }
  for (size_t i = 2; i < n_extremes; ++i) check_rope_position_value(e.names[i - 2], v[i]);
  if (v[1] < v[0]) return none;
  return {v[0] + offset, v[1] + offset};
}

namespace {

// (lo, hi) as an int64 tensor (2,) filled on the device (at::tensor of a list would copy
// from the host: a sync on CUDA).
at::Tensor filled_pair(const at::TensorOptions& options, int64_t lo, int64_t hi) {
  at::Tensor pair = at::empty({2}, options);
  pair.select(0, 0).fill_(lo);
  pair.select(0, 1).fill_(hi);
  return pair;
}

at::Tensor rope_position_extremes_of(const RopeCall& c) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  const at::TensorOptions options = c.q.options().dtype(at::kLong);
  const int64_t offset = c.concrete_offset();
  const at::Tensor qv = rope_canonical_view(c.q, c.layout);
  const int64_t batch = qv.size(0);
  const int64_t seq = qv.size(1);  // tokens for 'thd'
  if (batch == 0 || seq == 0) return filled_pair(options, kMax, kMin);
  if (!has_index_tensors(c)) return filled_pair(options, offset, offset + seq - 1);
  // Nothing is read back. What rope_position_bounds_of checks on the host (each operand in
  // [-2**53, 2**53], so that no sum wraps; cu_seqlens from 0 to the token count, never
  // decreasing) is a verdict on the device: an invalid call's bounds are (int64 min, int64
  // max), which no range admits (the CUDA kernels do not check index values themselves).
  const TensorExtremes e = tensor_extremes(c, batch, seq);
  at::Tensor valid = at::ones({}, e.lo.options().dtype(at::kBool));
  for (size_t i = 0; i < e.operands.size(); i += 2) {
    valid = valid & (e.operands[i] >= -kRopeMaxPosition) & (e.operands[i + 1] <= kRopeMaxPosition);
  }
  if (e.cu_summary.defined()) {
    valid = valid & (e.cu_summary[0] == 0) & (e.cu_summary[1] == seq) & (e.cu_summary[2] >= 0);
  }
  const at::Tensor tokens = e.hi >= e.lo;
  // Scalar operands, not tensors made from host values (a copy: a sync on CUDA).
  const at::Tensor lo = at::where(valid, at::where(tokens, e.lo + offset, e.lo), at::Scalar(kMin));
  const at::Tensor hi = at::where(valid, at::where(tokens, e.hi + offset, e.hi), at::Scalar(kMax));
  return at::stack({lo, hi}).to(c.q.device());
}

}  // namespace

void resolve_rope_seq_len(RopeCall& c) {
  const std::optional<int64_t> seq_len = c.seq_len.maybe_as_int();  // none: symbolic, a traced call
  if (!math::rope_scales_by_length(c.scaling.type) || seq_len != std::optional<int64_t>(-1)) return;
  // Tensors whose values this process reads: no subclass (Python key: FakeTensor, DTensor),
  // no functionalization or functorch wrapper.
  constexpr c10::DispatchKeySet wrappers({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                          c10::DispatchKey::FuncTorchBatched,
                                          c10::DispatchKey::FuncTorchGradWrapper});
  for (const std::optional<at::Tensor>* t : {&c.positions, &c.offsets, &c.cu_seqlens}) {
    if (!t->has_value()) continue;
    const at::Tensor& v = **t;
    if (!(v.is_cpu() || v.is_cuda()) || v.key_set().has_any(wrappers)) return;
  }
  if (c.q.key_set().has_any(wrappers)) return;
  check_rope_structure(c);
  check_rope_settings(c);
  c.seq_len = std::get<1>(rope_position_bounds_of(c)) + 1;  // 0 when it rotates nothing
}

namespace {

void rope_position_bounds_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeCall c = RopeCall::pop(*stack);
  check_rope_structure(c);
  check_rope_settings(c);
  auto [lo, hi] = rope_position_bounds_of(c);
  stack->emplace_back(lo);
  stack->emplace_back(hi);
}

void rope_position_extremes_boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeCall c = RopeCall::pop(*stack);
  check_rope_structure(c);
  check_rope_settings(c);
  stack->emplace_back(rope_position_extremes_of(c));
}

}  // namespace

// Composed of ATen ops, so one kernel serves every backend. rope_position_bounds reads
// values back, so it has no Meta form; rope_position_extremes keeps them on the device (the
// modules' range check under torch.compile, torch.export and torch.jit.trace): its Meta
// kernel is in rope.cpp with the family's other Meta kernels.
TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("rope_position_bounds",
         torch::CppFunction::makeFromBoxedFunction<&rope_position_bounds_boxed>());
  m.impl("rope_position_extremes",
         torch::CppFunction::makeFromBoxedFunction<&rope_position_extremes_boxed>());
}

}  // namespace ops
}  // namespace posenc
