// Autograd of qk_norm_rope, in C++ so that LibTorch apps get gradients too.
//
// Saved for backward: the inputs q, k and both weights (the norm is recomputed from them:
// no activation beyond what the caller already holds), the call's index tensors, and its
// settings. The backward is one fused op, qk_norm_rope_backward (the gradient turned back,
// then RMSNorm's backward, the weight gradients summed in the same pass); under
// create_graph it is the composite of ATen ops and rope instead
// (qk_norm_rope_backward_composite), which autograd differentiates again.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops/qk_norm_rope/qk_norm_rope.h"

namespace posenc {
namespace ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct SavedQkNormRopeSettings : torch::CustomClassHolder {
  explicit SavedQkNormRopeSettings(QkNormRopeCall c) : call(std::move(c)) {}
  QkNormRopeCall call;
};

class QkNormRopeFunction : public torch::autograd::Function<QkNormRopeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& q_weight, const at::Tensor& k_weight,
                               QkNormRopeCall call) {
    at::Tensor out_q, out_k;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out_q, out_k) = call_qk_norm_rope(call);
    }
    ctx->save_for_backward({q, k, q_weight, k_weight, call.rope.positions.value_or(at::Tensor()),
                            call.rope.offsets.value_or(at::Tensor()),
                            call.rope.cu_seqlens.value_or(at::Tensor())});
    call.rope.q = call.q_weight = call.k_weight = at::Tensor();
    call.rope.k = call.rope.positions = call.rope.offsets = call.rope.cu_seqlens = std::nullopt;
    ctx->saved_data["settings"] = c10::IValue::make_capsule(
        c10::make_intrusive<SavedQkNormRopeSettings>(std::move(call)));
    return {out_q, out_k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    QkNormRopeCall call = c10::static_intrusive_pointer_cast<SavedQkNormRopeSettings>(
                              ctx->saved_data["settings"].toCapsule())
                              ->call;
    call.rope.q = saved[0];
    call.rope.k = saved[1];
    call.q_weight = saved[2];
    call.k_weight = saved[3];
    call.rope.positions = maybe(saved[4]);
    call.rope.offsets = maybe(saved[5]);
    call.rope.cu_seqlens = maybe(saved[6]);
    // An output that took no part in the loss has no gradient: zeros.
    call.grad_q = grads[0].defined() ? grads[0] : at::zeros_like(saved[0]);
    call.grad_k = grads[1].defined() ? grads[1] : at::zeros_like(saved[1]);
    at::Tensor dq, dk, dwq, dwk;
    if (at::GradMode::is_enabled()) {
      std::tie(dq, dk, dwq, dwk) = qk_norm_rope_backward_composite(call);  // create_graph
    } else {
      std::tie(dq, dk, dwq, dwk) = call_qk_norm_rope_backward(call);
    }
    variable_list result(5);  // q, k, q_weight, k_weight, the call
    const at::Tensor* all[] = {&dq, &dk, &dwq, &dwk};
    for (int i = 0; i < 4; ++i) {
      if (ctx->needs_input_grad(i)) result[i] = *all[i];
    }
    return result;
  }
};

void qk_norm_rope_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  QkNormRopeCall call = QkNormRopeCall::pop(*stack, /*backward=*/false);
  const at::Tensor q = call.rope.q, k = *call.rope.k, wq = call.q_weight, wk = call.k_weight;
  variable_list out = QkNormRopeFunction::apply(q, k, wq, wk, std::move(call));
  stack->emplace_back(std::move(out[0]));
  stack->emplace_back(std::move(out[1]));
}

// qk_norm_rope_ overwrites q and k: refused when a graph would be recorded (as rope_), else
// the kernel below autograd, then the version counters bumped (a saved q or k is stale).
void qk_norm_rope_inplace_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const QkNormRopeCall call = QkNormRopeCall::pop(*stack, /*backward=*/false);
  const bool needs_grad =
      at::GradMode::is_enabled() && (call.rope.q.requires_grad() || call.rope.k->requires_grad() ||
                                     call.q_weight.requires_grad() || call.k_weight.requires_grad());
  TORCH_CHECK(!needs_grad,
              "posenc: qk_norm_rope: inplace=True overwrites q and k, which autograd cannot "
              "differentiate; use inplace=False for training, or run under torch.no_grad()");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    call_qk_norm_rope_inplace(call);
  }
  torch::autograd::impl::bump_version(call.rope.q);
  torch::autograd::impl::bump_version(*call.rope.k);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("qk_norm_rope", torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_autograd>());
  m.impl("qk_norm_rope_",
         torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_inplace_autograd>());
}

}  // namespace ops
}  // namespace posenc
