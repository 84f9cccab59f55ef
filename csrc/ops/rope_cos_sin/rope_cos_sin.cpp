// The op apply_rope_cos_sin: its schema, its checks and launch preparation (shared by the
// CPU and CUDA kernels), its Meta kernel, its CPU kernel (the vector-ISA unit cpu/kernel.cpp,
// built once per vector ISA, chosen at run time: cpu_capability.h) and the CUDA registration
// (the kernel: cuda/rope_cos_sin/rope_cos_sin.cu). The autograd is in autograd.cpp.
#include "ops/rope_cos_sin/rope_cos_sin.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/aten_fallback.h"
#include "ops/common/cpu/cpu_support.h"
#include "ops/common/meta_support.h"
#include "ops/common/op_handles.h"
#include "ops/common/py_format.h"
#include "ops/common/rope_composite.h"
#include "ops/common/rope_checks.h"
#include "ops/common/rope_launch.h"
#include "ops/rope_cos_sin/cpu/kernel.h"

namespace posenc {
namespace ops {

namespace {

constexpr const char* kFn = "apply_rope_cos_sin";

std::string shape_of(const at::Tensor& t) { return py_tuple(t.sizes()); }

}  // namespace

bool check_rope_cos_sin(const at::Tensor& q, const std::optional<at::Tensor>& k,
                        const at::Tensor& cos, const at::Tensor& sin, const std::string& layout) {
  TORCH_CHECK_VALUE(layout == "bhsd" || layout == "bshd", kFn, ": unknown layout ", py_str(layout),
                    "; expected one of bhsd, bshd");
  const bool bhsd = layout == "bhsd";
  const char* shape = bhsd ? "(batch, heads, seq, head_dim)" : "(batch, seq, heads, head_dim)";
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"cos", &cos},
                                {"sin", &sin}, {"k", k.has_value() ? &*k : nullptr}}) {
    if (t == nullptr) continue;
    // Not float8: the kernels have no float8 rows, and autograd cannot promote float8
    // (a float8 table was rotated with, then its backward failed inside torch).
    const at::ScalarType dt = t->scalar_type();
    TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16, kFn,
                     ": expected ", name, " to be a float16, bfloat16, float32 or float64 tensor, got ",
                     py_dtype(dt));
  }
  check_not_mixed_with_meta(kFn, {{"q", &q}, {"k", optional_ptr(k)}, {"cos", &cos}, {"sin", &sin}});
  TORCH_CHECK_VALUE(q.dim() == 4, kFn, ": expected q of shape ", shape, " for layout ",
                    py_str(layout), ", got ", shape_of(q));
  const int64_t seq_dim = bhsd ? 2 : 1;
  if (k.has_value()) {
    TORCH_CHECK_VALUE(k->dim() == 4 && k->sym_size(0) == q.sym_size(0) &&
                          k->sym_size(seq_dim) == q.sym_size(seq_dim) && k->sym_size(3) == q.sym_size(3),
                      kFn, ": expected k of shape ", shape,
                      " with q's batch, seq and head_dim (heads may differ), got k ", shape_of(*k),
                      " and q ", shape_of(q));
    TORCH_CHECK_TYPE(k->scalar_type() == q.scalar_type(), kFn, ": expected k to have q's dtype ",
                     py_dtype(q.scalar_type()), ", got ", py_dtype(k->scalar_type()));
    TORCH_CHECK_VALUE(k->device() == q.device(), kFn, ": expected k on q's device ", q.device(), ", got ",
                      k->device());
  }
  TORCH_CHECK_VALUE(cos.sym_sizes() == sin.sym_sizes(), kFn,
                    ": expected cos and sin of the same shape, got ", shape_of(cos), " and ",
                    shape_of(sin));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"cos", &cos}, {"sin", &sin}}) {
    TORCH_CHECK_VALUE(t->device() == q.device(), kFn, ": expected ", name, " on q's device ",
                      q.device(), ", got ", t->device());
  }
  // Symbolic sizes (the Meta kernel's, under torch.export with dynamic shapes): compared as
  // expressions, so a dynamic batch or sequence is not specialised to the example's.
  const c10::SymInt batch = q.sym_size(0), seq = q.sym_size(seq_dim);
  // size(d) would read every size of a traced tensor as an int (specialising them all);
  // sym_size(d) reads one. head_dim and rotary_dim are static in every model.
  const int64_t head_dim = q.sym_size(3).guard_int(__FILE__, __LINE__);
  TORCH_CHECK_VALUE((cos.dim() == 2 || cos.dim() == 3) && cos.sym_size(-2) == seq &&
                        (cos.dim() == 2 || cos.sym_size(0) == batch || cos.sym_size(0) == 1),
                    kFn, ": expected cos and sin of shape (seq, rotary_dim) or (batch, seq, rotary_dim) "
                    "with seq=", seq, " and batch=", batch, " (or 1), got ", shape_of(cos));
  const int64_t rot = cos.sym_size(-1).guard_int(__FILE__, __LINE__);
  TORCH_CHECK_VALUE(rot > 0 && rot % 2 == 0 && rot <= head_dim, kFn,
                    ": expected the tables' last dimension (rotary_dim) to be even and in [2, head_dim=",
                    head_dim, "], got ", rot);
  // Here, before any backend kernel: the CUDA kernel stages rotary_dim / 2 pairs per token in
  // shared memory and needs a thread per pair on its element path.
  check_rope_rotary_dim_supported(rot);
  return bhsd;
}

RopeCosSinLaunch prepare_rope_cos_sin(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                      const at::Tensor& cos, const at::Tensor& sin, bool bhsd,
                                      bool interleaved, bool transpose, const at::Tensor& out_q,
                                      const std::optional<at::Tensor>& out_k) {
  RopeCosSinLaunch launch;
  RopeCosSinArgs& a = launch.args;
  const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // One table row per batch row, or one shared by all: (table_batch, seq, rotary_dim).
  launch.cos = (cos.dim() == 2 ? cos.unsqueeze(0) : cos).to(acc).contiguous();
  launch.sin = (sin.dim() == 2 ? sin.unsqueeze(0) : sin).to(acc).contiguous();
  const auto canonical = [bhsd](const at::Tensor& x) { return bhsd ? x.transpose(1, 2) : x; };
  const at::Tensor qv = canonical(q);
  a.batch = qv.size(0);
  a.seq = qv.size(1);
  a.head_dim = qv.size(3);
  a.rotary_dim = cos.size(-1);
  a.interleaved = interleaved;
  a.transpose = transpose;
  a.cos = launch.cos.const_data_ptr();
  a.sin = launch.sin.const_data_ptr();
  a.table_batch_stride = launch.cos.size(0) == 1 ? 0 : launch.cos.stride(0);
  fill_rope_operand(a.q, canonical(q), canonical(out_q));
  if (k.has_value()) fill_rope_operand(a.k, canonical(*k), canonical(*out_k));
  return launch;
}

namespace {

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_meta(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  check_rope_cos_sin(q, k, cos, sin, std::string(layout));
  return {at::empty_like(q), k.has_value() ? at::empty_like(*k) : at::empty({0}, q.options())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (q rotated, k rotated or an empty tensor). transpose: the transposed rotation (backward).
  m.def(
      "apply_rope_cos_sin(Tensor q, Tensor? k, Tensor cos, Tensor sin, str layout=\"bhsd\", "
      "bool interleaved=False, bool transpose=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("apply_rope_cos_sin", absent_if_undefined<&apply_rope_cos_sin_meta>);
}

// ---- CPU: argument checks, outputs, the tables in the compute dtype, and the call of the
// vector-ISA kernel.
namespace {

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_cpu(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  const bool bhsd = check_rope_cos_sin(q, k, cos, sin, std::string(layout));
  at::Tensor out_q = empty_output_like(q);
  std::optional<at::Tensor> out_k;
  if (k.has_value()) out_k = empty_output_like(*k);
  if (q.numel() > 0 || (k.has_value() && k->numel() > 0)) {
    const RopeCosSinLaunch launch =
        prepare_rope_cos_sin(q, k, cos, sin, bhsd, interleaved, transpose, out_q, out_k);
    cpu::rope_cos_sin_stub::get()(launch.args, q.scalar_type());
  }
  return {out_q, out_k.has_value() ? *out_k : at::empty({0}, q.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("apply_rope_cos_sin", absent_if_undefined<&apply_rope_cos_sin_cpu>);
}

// ---- The ATen composite (devices without a kernel, aten_fallback.h): the tables split like
// the features, rotated in the compute dtype, rounded once.
namespace {

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_composite(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  const bool bhsd = check_rope_cos_sin(q, k, cos, sin, std::string(layout));
  warn_aten_fallback("apply_rope_cos_sin", q.device());
  const at::ScalarType acc = composite::compute_dtype(q);
  const int64_t rot = cos.size(-1);
  // The tables as (1 or batch, seq, 1, rot) in the compute dtype, split like the features.
  const auto table = [&](const at::Tensor& t) {
    const at::Tensor v = t.to(acc);
    return (v.dim() == 2 ? v.unsqueeze(0) : v).unsqueeze(2);
  };
  const auto [c1, c2] = composite::split_pairs(table(cos), rot, interleaved);
  const auto [s1, s2] = composite::split_pairs(table(sin), rot, interleaved);
  const auto rotate = [&](const at::Tensor& x) {
    const auto canonical = [bhsd](const at::Tensor& t) { return bhsd ? t.transpose(1, 2) : t; };
    at::Tensor out = composite::empty_output(x);
    canonical(out).copy_(
        composite::rotate_composite(canonical(x), c1, s1, c2, s2, rot, interleaved, transpose, acc));
    return out;
  };
  return {rotate(q), k.has_value() ? rotate(*k) : at::empty({0}, q.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("apply_rope_cos_sin", absent_if_undefined<&apply_rope_cos_sin_composite>);
}

}  // namespace ops
}  // namespace posenc

// ---- CUDA: the same checks and preparation, outputs from empty_like, and the launch of
// cuda/rope_cos_sin/rope_cos_sin.cu's kernel on q's device and current stream.
#if defined(POSENC_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/rope_cos_sin/launch.h"

namespace posenc {
namespace ops {
namespace {

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_cuda(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  const bool bhsd = check_rope_cos_sin(q, k, cos, sin, std::string(layout));
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out_q = at::empty_like(q);
  std::optional<at::Tensor> out_k;
  if (k.has_value()) out_k = at::empty_like(*k);
  const RopeCosSinLaunch launch =
      prepare_rope_cos_sin(q, k, cos, sin, bhsd, interleaved, transpose, out_q, out_k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "posenc_apply_rope_cos_sin_cuda", [&] {
    C10_CUDA_CHECK(launch_rope_cos_sin<scalar_t>(launch.args, at::cuda::getCurrentCUDAStream()));
  });
  return {out_q, out_k.has_value() ? *out_k : at::empty({0}, q.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("apply_rope_cos_sin", absent_if_undefined<&apply_rope_cos_sin_cuda>);
}

}  // namespace ops
}  // namespace posenc
#endif  // POSENC_WITH_CUDA
