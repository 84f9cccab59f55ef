// Autograd of qk_norm_rope, in C++ so that LibTorch apps get gradients too, written as
// PyTorch's own ops write theirs (common/autograd_node.h), so torch.func's transforms and
// forward-mode AD take it as well.
//
// y = rope(n(x) * w') with n(x) = x * rsqrt(mean(x^2) + eps) (over the head, or the token's
// whole projection) and w' = w + weight_offset, for x = q and x = k.
// - backward: one fused op, qk_norm_rope_backward (the gradient turned back, then RMSNorm's
//   backward, the weight gradients summed in the same pass). When the backward must itself
//   be differentiable (grad mode on: create_graph, every torch.func transform, or a tangent
//   on what it reads: forward-over-reverse) it is the composite of ATen ops and rope instead
//   (qk_norm_rope_backward_composite), which autograd differentiates again.
// - forward (jvp): dy = rope(J(x) dx * w' + n(x) dw), J RMSNorm's Jacobian. The part before
//   the rotation is qk_norm_tangent (qk_norm_rope.cpp), which shares the norm and its
//   Jacobian with the backward composite (J is symmetric: one product serves both); the
//   rotation is one call of the rope op with the call's RoPE settings, fused for q and k.
// Saved for backward: the inputs q, k and both weights (the norm is recomputed from them: no
// activation beyond what the caller already holds), the call's index tensors and settings.
//
// qk_norm_rope_ (in place) is for inference: inputs that require grad under grad mode, or
// carry a tangent, are refused; otherwise it bumps the version counters of q and k.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_node.h"
#include "ops/common/inference_only.h"
#include "ops/common/rope_launch.h"  // resolve_rope_seq_len
#include "ops/qk_norm_rope/qk_norm_rope.h"

namespace posenc {
namespace ops {
namespace {

namespace ag = autograd;

// Edges: q, k, q_weight, k_weight.
struct QkNormRopeBackward : ag::Node {
  QkNormRopeCall call;  // the settings; every tensor unset (saved below)
  ag::SavedVariable q, k, q_weight, k_weight, positions, offsets, cu_seqlens;

  std::string name() const override { return "posenc::QkNormRopeBackward"; }
  void release_variables() override {
    for (ag::SavedVariable* v : {&q, &k, &q_weight, &k_weight, &positions, &offsets, &cu_seqlens}) {
      v->reset_data();
    }
  }
  ag::variable_list apply(ag::variable_list&& grads) override {
    QkNormRopeCall c = call;
    c.rope.q = q.unpack();
    c.rope.k = k.unpack();
    c.q_weight = q_weight.unpack();
    c.k_weight = k_weight.unpack();
    c.rope.positions = ag::unpack(positions);
    c.rope.offsets = ag::unpack(offsets);
    c.rope.cu_seqlens = ag::unpack(cu_seqlens);
    // An output that took no part in the loss has no gradient: zeros.
    c.grad_q = grads[0].defined() ? grads[0] : at::zeros_like(c.rope.q);
    c.grad_k = grads[1].defined() ? grads[1] : at::zeros_like(*c.rope.k);
    at::Tensor dq, dk, dwq, dwk;
    if (at::GradMode::is_enabled() ||
        ag::has_tangent(c.rope.q, c.rope.k, c.q_weight, c.k_weight, c.grad_q, c.grad_k)) {
      std::tie(dq, dk, dwq, dwk) = qk_norm_rope_backward_composite(c);  // differentiable
    } else {
      std::tie(dq, dk, dwq, dwk) = call_qk_norm_rope_backward(c);  // one fused pass
    }
    // q and its weight reach out_q alone, k and its weight out_k: an output without a
    // gradient gives its inputs none (None, as apply_rope's), not the zeros computed above.
    ag::variable_list out{dq, dk, dwq, dwk};
    for (size_t i = 0; i < out.size(); ++i) {
      if (!should_compute_output(i) || !grads[i % 2].defined()) out[i] = at::Tensor();
    }
    return out;
  }
};

void qk_norm_rope_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  QkNormRopeCall call = QkNormRopeCall::pop(*stack, /*backward=*/false);
  const at::Tensor q = call.rope.q, k = *call.rope.k, wq = call.q_weight, wk = call.k_weight;
  auto node = ag::make_node<QkNormRopeBackward>(q, k, wq, wk);
  if (node || ag::has_tangent(q, k, wq, wk)) resolve_rope_seq_len(call.rope);  // once, not again by the backward
  at::Tensor out_q, out_k;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out_q, out_k) = call_qk_norm_rope(call);
  }
  if (node) {
    node->q = ag::SavedVariable(q, /*is_output=*/false);
    node->k = ag::SavedVariable(k, /*is_output=*/false);
    node->q_weight = ag::SavedVariable(wq, /*is_output=*/false);
    node->k_weight = ag::SavedVariable(wk, /*is_output=*/false);
    node->positions = ag::save(call.rope.positions);
    node->offsets = ag::save(call.rope.offsets);
    node->cu_seqlens = ag::save(call.rope.cu_seqlens);
    node->call = call;
    QkNormRopeCall& s = node->call;
    s.rope.q = s.q_weight = s.k_weight = at::Tensor();
    s.rope.k = s.rope.positions = s.rope.offsets = s.rope.cu_seqlens = std::nullopt;
    ag::record(node, out_q, out_k);
  }
  if (ag::has_tangent(q, k, wq, wk)) {
    // (first: it refuses a complex tangent, which the formula's real arithmetic would drop)
    const at::ScalarType dtype_q = ag::tangent_dtype(out_q, q, wq), dtype_k = ag::tangent_dtype(out_k, k, wk);
    QkNormRopeCall p = call;  // the formula reads the primals
    p.rope.q = ag::primal(q);
    p.rope.k = ag::primal(k);
    p.q_weight = ag::primal(wq);
    p.k_weight = ag::primal(wk);
    const at::Tensor uq = qk_norm_tangent(p, p.rope.q, p.q_weight, ag::tangent(q), ag::tangent(wq));
    const at::Tensor uk = qk_norm_tangent(p, *p.rope.k, p.k_weight, ag::tangent(k), ag::tangent(wk));
    auto [tq, tk] = call_rope_pair(p.rope, uq, uk);
    if (tq.defined()) ag::set_tangent(out_q, tq.to(dtype_q));
    if (tk.defined()) ag::set_tangent(out_k, tk.to(dtype_k));
  }
  stack->emplace_back(std::move(out_q));
  stack->emplace_back(std::move(out_k));
}

// qk_norm_rope_ overwrites q and k: refused when a graph would be recorded or a tangent
// carried (as rope_), else the kernel below autograd, through ADInplaceOrView
// (bump_written_versions: a saved q or k is stale).
void qk_norm_rope_inplace_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const QkNormRopeCall call = QkNormRopeCall::pop(*stack, /*backward=*/false);
  const at::Tensor& q = call.rope.q;
  const at::Tensor& k = *call.rope.k;
  TORCH_CHECK(!torch::autograd::compute_requires_grad(q, k, call.q_weight, call.k_weight),
              "posenc: qk_norm_rope: inplace=True overwrites q and k, which autograd cannot "
              "differentiate; use inplace=False for training, or run under torch.no_grad()");
  // (torch.no_grad does not turn forward AD off: its own advice.)
  TORCH_CHECK(!ag::has_tangent(q, k, call.q_weight, call.k_weight),
              "posenc: qk_norm_rope: inplace=True overwrites q and k, which cannot carry forward-mode "
              "AD tangents (torch.func.jvp, torch.autograd.forward_ad); use inplace=False");
  at::AutoDispatchBelowAutograd guard;
  call_qk_norm_rope_inplace(call);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("qk_norm_rope", torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_autograd>());
  m.impl("qk_norm_rope_",
         torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_inplace_autograd>());
}

POSENC_REGISTER_WRITTEN_LAYERS("qk_norm_rope_")

}  // namespace ops
}  // namespace posenc
