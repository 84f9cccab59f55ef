// Autograd of apply_rope_cos_sin, in C++ so that LibTorch apps get gradients too.
//
// The map is linear in x: per pair (e1, e2), y1 = x1 c1 - x2 s1 and y2 = x2 c2 + x1 s2
// (math::rope_rotate_pair_tables). The gradient of x is the transposed map applied to the
// incoming gradient: the same op with transpose flipped, fused for q and k. The gradients
// of the tables (rarely wanted: transformers computes them from a buffer) are sums over
// heads (and broadcast batch rows) of products of x and the gradient, composed of torch ops;
// x is saved only when a table requires grad.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "ops/common/op_handles.h"

namespace posenc {
namespace ops {
namespace {

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

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("apply_rope_cos_sin", &apply_rope_cos_sin_autograd);
}

}  // namespace ops
}  // namespace posenc
