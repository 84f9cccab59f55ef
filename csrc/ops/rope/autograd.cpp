// Autograd of the rope ops, in C++ so that LibTorch apps get gradients too.
//
// rope is linear in q and k: out = f * R(angle) x per pair, so the gradient is the
// transpose f * R(-angle) applied to the incoming gradient, i.e. the same call with
// inverse flipped, fused for q and k in one launch. Saved for backward: the call's settings
// and its index tensors (positions, offsets, cu_seqlens), no activation.
//
// rope_ (in place) is for inference: under grad mode with inputs that require grad it
// raises, since overwriting q would destroy what autograd needs; otherwise it bumps the
// version counters of q and k, as every in-place op must.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops/common/rope_call.h"

namespace posenc {
namespace ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The call's settings, kept in the autograd context (its tensors are saved apart, as
// saved variables, so that autograd checks their versions).
struct SavedRopeSettings : torch::CustomClassHolder {
  explicit SavedRopeSettings(RopeCall c) : call(std::move(c)) {}
  RopeCall call;
};

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  // q and k are passed apart from the call so that autograd sees them as the inputs.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q,
                               const std::optional<at::Tensor>& k, RopeCall call) {
    at::Tensor out_q, out_k;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out_q, out_k) = call_rope(call);
    }
    ctx->save_for_backward({call.positions.value_or(at::Tensor()),
                            call.offsets.value_or(at::Tensor()),
                            call.cu_seqlens.value_or(at::Tensor())});
    ctx->saved_data["has_k"] = k.has_value();
    call.q = at::Tensor();
    call.k = call.positions = call.offsets = call.cu_seqlens = std::nullopt;
    ctx->saved_data["settings"] =
        c10::IValue::make_capsule(c10::make_intrusive<SavedRopeSettings>(std::move(call)));
    if (!k.has_value()) ctx->mark_non_differentiable({out_k});
    return {out_q, out_k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_k = ctx->saved_data["has_k"].toBool();
    RopeCall call = c10::static_intrusive_pointer_cast<SavedRopeSettings>(
                        ctx->saved_data["settings"].toCapsule())
                        ->call;
    call.q = grads[0];
    call.k = has_k ? std::optional<at::Tensor>(grads[1]) : std::nullopt;
    call.positions = maybe(saved[0]);
    call.offsets = maybe(saved[1]);
    call.cu_seqlens = maybe(saved[2]);
    call.inverse = !call.inverse;
    auto [grad_q, grad_k] = call_rope(call);
    variable_list result(3);  // q, k, the call
    if (ctx->needs_input_grad(0)) result[0] = grad_q;
    if (has_k && ctx->needs_input_grad(1)) result[1] = grad_k;
    return result;
  }
};

void rope_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  RopeCall call = RopeCall::pop(*stack);
  const at::Tensor q = call.q;
  const std::optional<at::Tensor> k = call.k;
  variable_list out = RopeFunction::apply(q, k, std::move(call));
  stack->emplace_back(std::move(out[0]));
  stack->emplace_back(std::move(out[1]));
}

void rope_inplace_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeCall call = RopeCall::pop(*stack);
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (call.q.requires_grad() || (call.k.has_value() && call.k->requires_grad()));
  TORCH_CHECK(!needs_grad,
              "posenc: inplace=True rotates q and k in their own storage, which autograd cannot "
              "differentiate; use inplace=False for training, or run under torch.no_grad()");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    call_rope_inplace(call);
  }
  torch::autograd::impl::bump_version(call.q);
  if (call.k.has_value()) torch::autograd::impl::bump_version(*call.k);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("rope", torch::CppFunction::makeFromBoxedFunction<&rope_autograd>());
  m.impl("rope_", torch::CppFunction::makeFromBoxedFunction<&rope_inplace_autograd>());
}

}  // namespace ops
}  // namespace posenc
