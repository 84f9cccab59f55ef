// The op apply_rope_cos_sin: its schema, its checks and launch preparation (shared by the
// CPU and CUDA kernels, cpu/rope_cos_sin_cpu.cpp and cuda/rope_cos_sin/rope_cos_sin.cu), its Meta
// kernel and its autograd.
//
// The map is linear in x: per pair (e1, e2), y1 = x1 c1 - x2 s1 and y2 = x2 c2 + x1 s2
// (math::rope_rotate_pair_tables). The gradient of x is the transposed map applied to the
// incoming gradient: the same op with transpose flipped, fused for q and k. The gradients
// of the tables (rarely wanted: transformers computes them from a buffer) are sums over
// heads (and broadcast batch rows) of products of x and the gradient, composed of torch ops;
// x is saved only when a table requires grad.
#include "ops/rope_cos_sin/rope_cos_sin.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/common/py_format.h"
#include "ops/common/meta_support.h"
#include "ops/common/op_handles.h"
#include "ops/common/rope_checks.h"
#include "ops/common/rope_launch.h"

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
    TORCH_CHECK_TYPE(at::isFloatingType(t->scalar_type()), kFn, ": expected ", name,
                     " to be a floating-point tensor, got ", py_dtype(t->scalar_type()));
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
    TORCH_CHECK_VALUE(k->scalar_type() == q.scalar_type() && k->device() == q.device(), kFn,
                      ": expected k on q's device with q's dtype (", py_dtype(q.scalar_type()), ", ",
                      q.device(), "), got ", py_dtype(k->scalar_type()), ", ", k->device());
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

at::Tensor sum_to_table(const at::Tensor& per_head, const at::Tensor& table) {
  // per_head: (batch, seq, heads, rotary_dim); table: (seq, rot), (1, seq, rot) or (batch, ...).
  at::Tensor g = per_head.sum(2);
  if (table.dim() == 2) return g.sum(0);
  return table.size(0) == 1 && g.size(0) != 1 ? g.sum(0, /*keepdim=*/true) : g;
}

// d(out)/d(cos) and d(out)/d(sin) contracted with the gradient, for one of q and k (as
// (batch, seq, heads, head_dim) views), see math::rope_rotate_pair_tables.
std::pair<at::Tensor, at::Tensor> table_gradients(const at::Tensor& x, const at::Tensor& g,
                                                  int64_t rot, bool interleaved, bool transpose) {
  const auto part = [&](const at::Tensor& t, int first) {
    return interleaved ? t.slice(3, first, rot, 2) : t.slice(3, first * (rot / 2), (first + 1) * (rot / 2));
  };
  const at::Tensor x1 = part(x, 0), x2 = part(x, 1), g1 = part(g, 0), g2 = part(g, 1);
  const at::Tensor dc1 = g1 * x1, dc2 = g2 * x2;
  const at::Tensor ds1 = transpose ? -(g2 * x1) : -(g1 * x2);
  const at::Tensor ds2 = transpose ? g1 * x2 : g2 * x1;
  const auto join = [&](const at::Tensor& a, const at::Tensor& b) {
    return interleaved ? at::stack({a, b}, -1).flatten(-2) : at::cat({a, b}, -1);
  };
  return {join(dc1, dc2), join(ds1, ds2)};
}

class RopeCosSinFunction : public torch::autograd::Function<RopeCosSinFunction> {
 public:
  // k: an empty placeholder when has_k is false (autograd inputs must be defined tensors).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k, bool has_k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                std::string layout, bool interleaved, bool transpose) {
    const std::optional<at::Tensor> maybe_k = has_k ? std::optional<at::Tensor>(k) : std::nullopt;
    at::Tensor out_q, out_k;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out_q, out_k) =
          apply_rope_cos_sin_op().call(q, maybe_k, cos, sin, layout, interleaved, transpose);
    }
    const bool tables = cos.requires_grad() || sin.requires_grad();
    ctx->save_for_backward({cos, sin, tables ? q : at::Tensor(), tables && has_k ? k : at::Tensor()});
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["transpose"] = transpose;
    ctx->saved_data["has_k"] = has_k;
    // Symbolic: concrete sizes would specialise a dynamic batch or sequence under export.
    ctx->saved_data["q_sizes"] = c10::IValue(q.sym_sizes());
    if (!has_k) ctx->mark_non_differentiable({out_k});
    return {out_q, out_k};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &cos = saved[0], &sin = saved[1], &q = saved[2], &k = saved[3];
    const std::string layout = ctx->saved_data["layout"].toStringRef();
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool transpose = ctx->saved_data["transpose"].toBool();
    const bool has_k = ctx->saved_data["has_k"].toBool();
    const bool bhsd = layout == "bhsd";
    const at::Tensor g_q = grads[0];  // undefined when that output was not used
    const at::Tensor g_k = has_k ? grads[1] : at::Tensor();
    torch::autograd::variable_list out(8);  // one per forward argument
    if ((ctx->needs_input_grad(0) || ctx->needs_input_grad(1)) && (g_q.defined() || g_k.defined())) {
      // The op rotates a q and an optional k: an unused q output has a zero gradient.
      const at::Tensor a = g_q.defined()
                               ? g_q
                               : at::zeros_symint(ctx->saved_data["q_sizes"].toSymIntVector(), g_k.options());
      auto [rq, rk] = apply_rope_cos_sin_op().call(
          a, g_k.defined() ? std::optional<at::Tensor>(g_k) : std::nullopt, cos, sin, layout,
          interleaved, !transpose);
      out[0] = rq;
      if (g_k.defined()) out[1] = rk;
    }
    // needs_input_grad counts tensor inputs only: q, k, cos, sin.
    if ((ctx->needs_input_grad(2) || ctx->needs_input_grad(3)) && q.defined()) {
      const int64_t rot = cos.size(-1);
      const auto canonical = [bhsd](const at::Tensor& x) { return bhsd ? x.transpose(1, 2) : x; };
      at::Tensor dcos, dsin;
      for (const auto& [x, g] : {std::pair<at::Tensor, at::Tensor>{q, g_q}, {k, g_k}}) {
        if (!x.defined() || !g.defined()) continue;
        auto [dc, ds] = table_gradients(canonical(x), canonical(g), rot, interleaved, transpose);
        dc = sum_to_table(dc, cos);
        ds = sum_to_table(ds, sin);
        dcos = dcos.defined() ? dcos + dc : dc;
        dsin = dsin.defined() ? dsin + ds : ds;
      }
      if (dcos.defined()) {
        out[3] = dcos.to(cos.scalar_type());
        out[4] = dsin.to(sin.scalar_type());
      }
    }
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_autograd(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  const at::Tensor k_or_placeholder = k.has_value() ? *k : at::empty({0}, q.options());
  auto out = RopeCosSinFunction::apply(q, k_or_placeholder, k.has_value(), cos, sin,
                                       std::string(layout), interleaved, transpose);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (q rotated, k rotated or an empty tensor). transpose: the transposed rotation (backward).
  m.def(
      "apply_rope_cos_sin(Tensor q, Tensor? k, Tensor cos, Tensor sin, str layout=\"bhsd\", "
      "bool interleaved=False, bool transpose=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(posenc, Meta, m) { m.impl("apply_rope_cos_sin", &apply_rope_cos_sin_meta); }

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("apply_rope_cos_sin", &apply_rope_cos_sin_autograd);
}

}  // namespace ops
}  // namespace posenc
