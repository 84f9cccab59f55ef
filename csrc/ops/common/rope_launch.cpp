#include "ops/common/rope_launch.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "ops/common/rope_checks.h"

namespace posenc {
namespace ops {

void fill_rope_operand(RopeOperand& op, const at::Tensor& in, const at::Tensor& out) {
  op.in = in.const_data_ptr();
  op.out = out.mutable_data_ptr();
  op.heads = in.size(2);
  for (int d = 0; d < 4; ++d) {
    op.in_stride[d] = in.stride(d);
    op.out_stride[d] = out.stride(d);
  }
}

namespace {

int64_t* long_data(const at::Tensor& t) { return t.defined() ? t.data_ptr<int64_t>() : nullptr; }

// CPU index values are checked here, where reading them is a pass over a few integers per
// token: a position outside the domain would wrap the int64 sum silently, a bad cu_seqlens
// read out of bounds. (CUDA ones are read only where a sync is paid anyway: the modules'
// range check, "dynamic"; the kernels stop with a device-side assert on a packed token
// outside every sequence, and write NaN there only when asserts are compiled out.)
void check_cpu_index_values(const RopeLaunch& launch) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"positions", &launch.positions},
                                {"offsets", &launch.offsets}}) {
    if (!t->defined() || !t->is_cpu()) continue;
    const int64_t* v = t->const_data_ptr<int64_t>();
    for (int64_t i = 0, n = t->numel(); i < n; ++i) check_rope_position_value(name, v[i]);
  }
  const RopeArgs& a = launch.args;
  if (!launch.cu_seqlens.defined() || !launch.cu_seqlens.is_cpu()) return;
  const int64_t* cu = a.cu_seqlens;
  bool ok = cu[0] == 0 && cu[a.num_seqs] == a.seq;
  for (int64_t j = 0; ok && j < a.num_seqs; ++j) ok = cu[j] <= cu[j + 1];
  if (ok) return;
  std::ostringstream values;
  const int64_t shown = std::min<int64_t>(a.num_seqs + 1, 16);
  for (int64_t j = 0; j < shown; ++j) values << (j ? ", " : "") << cu[j];
  if (shown < a.num_seqs + 1) values << ", ...";
  TORCH_CHECK_VALUE(false, "posenc: expected cu_seqlens to start at 0, never decrease and ",
                    "end at the number of tokens ", a.seq, ", got [", values.str(), "]");
}

}  // namespace

RopeLaunch prepare_rope_launch(const RopeCall& c, int64_t rot, const at::Tensor& out_q,
                               const std::optional<at::Tensor>& out_k) {
  const int64_t offset = c.concrete_offset();
  int64_t seq_len = c.concrete_seq_len();
  if (math::rope_scales_by_length(c.scaling.type) && seq_len < 0) {
    seq_len = std::get<1>(rope_position_bounds_of(c)) + 1;  // 0 when it rotates nothing
  }
  const RopePairFrequencies f = rope_pair_frequencies(
      rot, c.base, c.scaling, std::max<int64_t>(seq_len, 0), c.sections, c.sections_mode);

  RopeLaunch launch;
  RopeArgs& a = launch.args;
  launch.q_in = rope_canonical_view(c.q, c.layout);
  a.batch = launch.q_in.size(0);
  a.seq = launch.q_in.size(1);
  a.head_dim = launch.q_in.size(3);
  a.rotary_dim = rot;
  a.interleaved = c.interleaved;
  a.inverse = c.inverse;
  a.settings = c.settings;
  a.offset = offset;
  a.attention_factor = f.attention_factor;
  std::copy(f.inv_freq.begin(), f.inv_freq.end(), a.inv_freq);
  std::copy(f.axis.begin(), f.axis.end(), a.pair_axis);
  a.n_axes = c.n_axes();

  launch.q_out = rope_canonical_view(out_q, c.layout);
  fill_rope_operand(a.q, launch.q_in, launch.q_out);
  if (c.k.has_value()) {
    launch.k_in = rope_canonical_view(*c.k, c.layout);
    launch.k_out = rope_canonical_view(*out_k, c.layout);
    fill_rope_operand(a.k, launch.k_in, launch.k_out);
  }

  if (c.positions.has_value()) {
    launch.positions = c.positions->contiguous();
    a.positions = long_data(launch.positions);
    // (seq,), (1, seq) and their (axes, ...) forms are shared by the batch rows; (batch,
    // seq) and (axes, batch, seq) are not.
    const int64_t batch_dims = c.positions->dim() - (c.multi_axis() ? 1 : 0);
    const bool per_row = batch_dims == 2 && c.positions->size(c.positions->dim() - 2) == a.batch &&
                         a.batch != 1;
    a.positions_batch_stride = per_row ? a.seq : 0;
    a.positions_axis_stride = c.multi_axis() ? launch.positions.stride(0) : 0;
  }
  if (c.offsets.has_value()) {
    launch.offsets = c.offsets->contiguous();
    a.offsets = long_data(launch.offsets);
  }
  if (c.cu_seqlens.has_value()) {
    // A CUDA int32 cu_seqlens (flash-attention's) is read as it is: converting it would be
    // a kernel launch per call. CPU ones become int64 (the CPU kernel and the value check
    // read int64; a few integers).
    if (c.cu_seqlens->scalar_type() == at::kInt && !c.cu_seqlens->is_cpu()) {
      launch.cu_seqlens = c.cu_seqlens->contiguous();
      a.cu_seqlens32 = launch.cu_seqlens.const_data_ptr<int32_t>();
    } else {
      launch.cu_seqlens = c.cu_seqlens->to(at::kLong).contiguous();
      a.cu_seqlens = long_data(launch.cu_seqlens);
    }
    a.num_seqs = launch.cu_seqlens.size(0) - 1;
  }
  check_cpu_index_values(launch);
  return launch;
}

void run_rope_boxed(torch::jit::Stack* stack, bool in_place, RopeOutputAllocator allocate,
                    RopeKernelRunner run) {
  const RopeCall c = RopeCall::pop(*stack);
  const int64_t rot = check_rope_structure(c);
  check_rope_settings(c);
  if (in_place) {
    check_rope_inplace(c);
    run(prepare_rope_launch(c, rot, c.q, c.k), c.q);
    return;
  }
  at::Tensor out_q = allocate(c.q);
  std::optional<at::Tensor> out_k;
  if (c.k.has_value()) out_k = allocate(*c.k);
  run(prepare_rope_launch(c, rot, out_q, out_k), c.q);
  stack->emplace_back(std::move(out_q));
  stack->emplace_back(out_k.has_value() ? std::move(*out_k) : at::empty({0}, c.q.options()));
}

}  // namespace ops
}  // namespace posenc
