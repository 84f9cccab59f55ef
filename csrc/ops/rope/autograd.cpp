// Autograd of the rope ops, in C++ so that LibTorch apps get gradients too, written as
// PyTorch's own ops write theirs (common/autograd_node.h), so torch.func's transforms and
// forward-mode AD take it as well.
//
// rope is linear in q and k: out = f * R(angle) x per pair. Its derivatives are the op itself:
// - backward: the transpose f * R(-angle) applied to the incoming gradient, i.e. the same
//   call with inverse flipped, fused for q and k in one launch;
// - forward (jvp): the tangent of rope(x) is rope(tangent), the same call.
// Saved for backward: the call's settings and its index tensors (positions, offsets,
// cu_seqlens), no activation.
//
// rope_ (in place) is for inference: inputs that require grad under grad mode, or carry a
// tangent, are refused, since overwriting q would destroy what autograd needs; otherwise it
// bumps the version counters of q and k, as every in-place op must.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_node.h"
#include "ops/common/inference_only.h"
#include "ops/common/rope_call.h"
#include "ops/common/rope_launch.h"  // resolve_rope_seq_len

namespace posenc {
namespace ops {
namespace {

namespace ag = autograd;

struct RopeBackward : ag::Node {
  RopeCall call;  // the settings; q, k and the index tensors unset (saved below)
  ag::SavedVariable positions, offsets, cu_seqlens;
  bool has_k = false;

  std::string name() const override { return "posenc::RopeBackward"; }
  void release_variables() override {
    positions.reset_data();
    offsets.reset_data();
    cu_seqlens.reset_data();
  }
  ag::variable_list apply(ag::variable_list&& grads) override {
    RopeCall c = call;
    c.positions = ag::unpack(positions);
    c.offsets = ag::unpack(offsets);
    c.cu_seqlens = ag::unpack(cu_seqlens);
    c.inverse = !c.inverse;  // the transpose of a rotation
    const at::Tensor gq = should_compute_output(0) ? grads[0] : at::Tensor();
    const at::Tensor gk = has_k && should_compute_output(1) ? grads[1] : at::Tensor();
    auto [dq, dk] = call_rope_pair(std::move(c), gq, gk);
    return {dq, dk};  // one per input edge (k's is empty when k is None)
  }
};

void rope_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  RopeCall call = RopeCall::pop(*stack);
  const at::Tensor q = call.q;
  const std::optional<at::Tensor> k = call.k;
  auto node = ag::make_node<RopeBackward>(q, k);
  if (node || ag::has_tangent(q, k)) resolve_rope_seq_len(call);  // read once, not again by the backward
  at::Tensor out_q, out_k;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out_q, out_k) = call_rope(call);
  }
  if (node) {
    node->positions = ag::save(call.positions);
    node->offsets = ag::save(call.offsets);
    node->cu_seqlens = ag::save(call.cu_seqlens);
    node->has_k = k.has_value();
    node->call = call;
    node->call.q = at::Tensor();
    node->call.k = node->call.positions = node->call.offsets = node->call.cu_seqlens = std::nullopt;
    if (k.has_value()) {
      ag::record(node, out_q, out_k);
    } else {
      ag::record(node, out_q);  // the empty k placeholder is not differentiable
    }
  }
  if (ag::has_tangent(q, k)) {
    auto [tq, tk] = call_rope_pair(call, ag::tangent(q), ag::tangent(k));
    ag::set_tangent(out_q, tq);
    ag::set_tangent(out_k, tk);
  }
  stack->emplace_back(std::move(out_q));
  stack->emplace_back(std::move(out_k));
}

void rope_inplace_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeCall call = RopeCall::pop(*stack);
  TORCH_CHECK(!torch::autograd::compute_requires_grad(call.q, call.k),
              "posenc: inplace=True rotates q and k in their own storage, which autograd cannot "
              "differentiate; use inplace=False for training, or run under torch.no_grad()");
  // (torch.no_grad does not turn forward AD off: its own advice.)
  TORCH_CHECK(!ag::has_tangent(call.q, call.k),
              "posenc: inplace=True rotates q and k in their own storage, which cannot carry their "
              "forward-mode AD tangents (torch.func.jvp, torch.autograd.forward_ad); use inplace=False");
  // Below autograd: ADInplaceOrView (bump_written_versions) moves q's and k's versions.
  at::AutoDispatchBelowAutograd guard;
  call_rope_inplace(call);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<&rope_autograd>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<&rope_inplace_autograd>());
}

POSENC_REGISTER_WRITTEN_LAYERS("rope_")

}  // namespace ops
}  // namespace posenc
