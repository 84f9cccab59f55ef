// Autograd of apply_rope_cos_sin, in C++ so that LibTorch apps get gradients too, written as
// PyTorch's own ops write theirs (common/autograd_node.h), so torch.func's transforms and
// forward-mode AD take it as well.
//
// The map is bilinear in x and the tables (cos, sin) on the first rotary_dim features: per
// pair (e1, e2), y1 = x1 c1 - x2 s1 and y2 = x2 c2 + x1 s2 (math::rope_rotate_pair_tables);
// the features past rotary_dim pass through (linear in x alone).
// - backward: the gradient of x is the transposed map applied to the incoming gradient, the
//   same op with transpose flipped, fused for q and k; the gradients of the tables (rarely
//   wanted: transformers computes them from a buffer) are sums over heads (and broadcast
//   batch rows) of products of x and the gradient, composed of torch ops (table_gradients);
// - forward (jvp): bilinear, so the tangent is op(x_t, cos, sin) + op(x, cos_t, sin_t), two
//   calls of the op itself (the second only when a table carries a tangent, its pass-through
//   features dropped). The formula reads the primals (_fw_primal), as PyTorch's kernels do.
// Saved for backward: the tables; x only when a table requires grad.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/common/autograd_node.h"
#include "ops/common/op_handles.h"

namespace posenc {
namespace ops {
namespace {

namespace ag = autograd;

at::Tensor sum_to_table(const at::Tensor& per_head, const at::Tensor& table) {
  // per_head: (batch, seq, heads, rotary_dim); table: (seq, rot), (1, seq, rot) or (batch, ...).
  at::Tensor g = per_head.sum(2);
  if (table.dim() == 2) return g.sum(0);
  return table.sym_size(0) == 1 && g.sym_size(0) != 1 ? g.sum(0, /*keepdim=*/true) : g;
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
    if (!interleaved) return at::cat({a, b}, -1);
    // (..., rot/2, 2) -> (..., rot): reshape, not flatten (which gradcheck's batched
    // gradients, the legacy vmap, cannot batch).
    std::vector<c10::SymInt> sizes = a.sym_sizes().vec();
    sizes.back() = sizes.back() * 2;
    return at::stack({a, b}, -1).reshape_symint(sizes);
  };
  return {join(dc1, dc2), join(ds1, ds2)};
}

// The settings of a call (everything but the tensors).
struct CosSinSettings {
  std::string layout;
  bool interleaved = false;
  bool transpose = false;
};

// The op on (a, b) with the given tables (ag::call_pair: either may be undefined; a lone b is
// rotated as the op's q, since q and k share batch, seq and head_dim, which is all the tables
// are checked against).
std::pair<at::Tensor, at::Tensor> rotate_pair(const at::Tensor& a, const at::Tensor& b,
                                              const at::Tensor& cos, const at::Tensor& sin,
                                              const CosSinSettings& s) {
  return ag::call_pair(a, b, [&](const at::Tensor& x, const std::optional<at::Tensor>& y) {
    return apply_rope_cos_sin_op().call(x, y, cos, sin, s.layout, s.interleaved, s.transpose);
  });
}

at::Tensor add_defined(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return a + b;
}

// Edges: q, k (an empty edge when the call has none), cos, sin.
struct RopeCosSinBackward : ag::Node {
  CosSinSettings settings;
  ag::SavedVariable cos, sin, q, k;  // q and k: only when a table requires grad
  bool has_k = false;

  std::string name() const override { return "posenc::RopeCosSinBackward"; }
  void release_variables() override {
    cos.reset_data();
    sin.reset_data();
    q.reset_data();
    k.reset_data();
  }
  ag::variable_list apply(ag::variable_list&& grads) override {
    const at::Tensor c = cos.unpack(), s = sin.unpack();
    const at::Tensor g_q = grads[0];  // undefined when that output was not used
    const at::Tensor g_k = has_k ? grads[1] : at::Tensor();
    ag::variable_list out(4);
    if (should_compute_output(0) || (has_k && should_compute_output(1))) {
      CosSinSettings back = settings;
      back.transpose = !back.transpose;  // the transpose of the map
      auto [dq, dk] = rotate_pair(should_compute_output(0) ? g_q : at::Tensor(),
                                  has_k && should_compute_output(1) ? g_k : at::Tensor(), c, s, back);
      out[0] = dq;
      out[1] = dk;
    }
    if (should_compute_output(2) || should_compute_output(3)) {
      const int64_t rot = c.sym_size(-1).guard_int(__FILE__, __LINE__);
      const bool bhsd = settings.layout == "bhsd";
      const auto canonical = [bhsd](const at::Tensor& x) { return bhsd ? x.transpose(1, 2) : x; };
      at::Tensor dcos, dsin;
      for (const auto& [x, g] : {std::pair<at::Tensor, at::Tensor>{q.unpack(), g_q}, {k.unpack(), g_k}}) {
        if (!x.defined() || !g.defined()) continue;
        // Products and sums in the precision of the forward's arithmetic (x's opmath type,
        // float32 for half x) or the table's if wider, then rounded once to the table's
        // dtype: in half precision a float32 table's gradient (a sum over batch and heads)
        // overflowed to inf and lost 3 digits.
        const at::ScalarType acc = at::promote_types(at::toOpMathType(x.scalar_type()), c.scalar_type());
        auto [dc, ds] = table_gradients(canonical(x).to(acc), canonical(g).to(acc), rot, settings.interleaved,
                                        settings.transpose);
        dcos = add_defined(dcos, sum_to_table(dc, c));
        dsin = add_defined(dsin, sum_to_table(ds, s));
      }
      if (dcos.defined()) {
        if (should_compute_output(2)) out[2] = dcos.to(c.scalar_type());
        if (should_compute_output(3)) out[3] = dsin.to(s.scalar_type());
      }
    }
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_autograd(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
    const at::Tensor& sin, c10::string_view layout, bool interleaved, bool transpose) {
  const CosSinSettings settings{std::string(layout), interleaved, transpose};
  auto node = ag::make_node<RopeCosSinBackward>(q, k, cos, sin);
  at::Tensor out_q, out_k;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out_q, out_k) =
        apply_rope_cos_sin_op().call(q, k, cos, sin, layout, interleaved, transpose);
  }
  if (node) {
    node->settings = settings;
    node->has_k = k.has_value();
    node->cos = ag::SavedVariable(cos, /*is_output=*/false);
    node->sin = ag::SavedVariable(sin, /*is_output=*/false);
    if (torch::autograd::compute_requires_grad(cos, sin)) {
      node->q = ag::SavedVariable(q, /*is_output=*/false);
      node->k = ag::save(k);
    }
    if (k.has_value()) {
      ag::record(node, out_q, out_k);
    } else {
      ag::record(node, out_q);  // the empty k placeholder is not differentiable
    }
  }
  if (ag::has_tangent(q, k, cos, sin)) {
    // Bilinear: d(op(x, c, s)) = op(dx, c, s) + op(x, dc, ds).
    const at::Tensor pc = ag::primal(cos), ps = ag::primal(sin);
    auto [tq, tk] = rotate_pair(ag::tangent(q), ag::tangent(k), pc, ps, settings);
    if (ag::has_tangent(cos, sin)) {
      const at::Tensor tc = ag::tangent(cos), ts = ag::tangent(sin);
      // In the tables' tangents' dtype where it is wider than x's (the op returns x's dtype).
      auto [uq, uk] = rotate_pair(ag::primal(q).to(ag::tangent_dtype(q, cos, sin)),
                                  k.has_value() ? ag::primal(*k).to(ag::tangent_dtype(*k, cos, sin)) : at::Tensor(),
                                  tc.defined() ? tc : at::zeros_like(pc),
                                  ts.defined() ? ts : at::zeros_like(ps), settings);
      // The features past rotary_dim pass through: linear in x alone, so op(x, dc, ds)'s copy
      // of them is no part of the derivative.
      const int64_t rot = cos.sym_size(-1).guard_int(__FILE__, __LINE__);
      const int64_t head_dim = q.sym_size(-1).guard_int(__FILE__, __LINE__);
      const auto rotated_part = [&](const at::Tensor& u) {
        return rot == head_dim || !u.defined() ? u : at::constant_pad_nd(u.narrow(-1, 0, rot), {0, head_dim - rot});
      };
      tq = add_defined(tq, rotated_part(uq));
      tk = add_defined(tk, rotated_part(uk));
    }
    ag::set_tangent(out_q, tq);
    if (k.has_value()) ag::set_tangent(out_k, tk);
  }
  return {out_q, out_k};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("apply_rope_cos_sin", absent_if_undefined<&apply_rope_cos_sin_autograd>);
}

}  // namespace ops
}  // namespace posenc
