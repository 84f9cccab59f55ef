// Autograd of the rope ops, in C++ so that LibTorch apps get gradients too.
//
// rope is linear in q and k: out = f * R(angle) x per pair, so the gradient is the
// transpose f * R(-angle) applied to the incoming gradient, i.e. the same op with
// inverse flipped, fused for q and k in one launch. Saved for backward: the index tensors
// (positions, offsets, cu_seqlens) and scalars, no activation.
//
// rope_ (in place) is for inference: under grad mode with inputs that require grad it
// raises, since overwriting q would destroy what autograd needs; otherwise it bumps the
// version counters of q and k, as every in-place op must.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include "ops/op_handles.h"

namespace posenc {
namespace ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

std::string to_string(c10::string_view s) { return std::string(s.data(), s.size()); }

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q,
                               const std::optional<at::Tensor>& k,
                               const std::optional<at::Tensor>& positions,
                               const std::optional<at::Tensor>& offsets, c10::SymInt offset,
                               const std::optional<at::Tensor>& cu_seqlens, double base,
                               c10::string_view rope_type, at::ArrayRef<double> scaling,
                               int64_t seq_len, int64_t rotary_dim, bool interleaved,
                               c10::string_view layout, bool inverse) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out_q, out_k] =
        rope_op().call(q, k, positions, offsets, offset, cu_seqlens, base, rope_type, scaling,
                       seq_len, rotary_dim, interleaved, layout, inverse);
    ctx->save_for_backward({positions.value_or(at::Tensor()), offsets.value_or(at::Tensor()),
                            cu_seqlens.value_or(at::Tensor())});
    ctx->saved_data["has_k"] = k.has_value();
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["base"] = base;
    ctx->saved_data["rope_type"] = to_string(rope_type);
    ctx->saved_data["scaling"] = std::vector<double>(scaling.begin(), scaling.end());
    ctx->saved_data["seq_len"] = seq_len;
    ctx->saved_data["rotary_dim"] = rotary_dim;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["layout"] = to_string(layout);
    ctx->saved_data["inverse"] = inverse;
    if (!k.has_value()) ctx->mark_non_differentiable({out_k});
    return {out_q, out_k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_k = ctx->saved_data["has_k"].toBool();
    const std::string rope_type = ctx->saved_data["rope_type"].toStringRef();
    const std::string layout = ctx->saved_data["layout"].toStringRef();
    const std::vector<double> scaling = ctx->saved_data["scaling"].toDoubleVector();
    auto [grad_q, grad_k] = rope_op().call(
        grads[0], has_k ? std::optional<at::Tensor>(grads[1]) : std::nullopt, maybe(saved[0]),
        maybe(saved[1]), ctx->saved_data["offset"].toSymInt(), maybe(saved[2]),
        ctx->saved_data["base"].toDouble(), rope_type, scaling,
        ctx->saved_data["seq_len"].toInt(), ctx->saved_data["rotary_dim"].toInt(),
        ctx->saved_data["interleaved"].toBool(), layout, !ctx->saved_data["inverse"].toBool());
    variable_list result(14);
    if (ctx->needs_input_grad(0)) result[0] = grad_q;
    if (has_k && ctx->needs_input_grad(1)) result[1] = grad_k;
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor> rope_autograd(
    const at::Tensor& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& offsets,
    c10::SymInt offset, const std::optional<at::Tensor>& cu_seqlens, double base,
    c10::string_view rope_type, at::ArrayRef<double> scaling, int64_t seq_len,
    int64_t rotary_dim, bool interleaved, c10::string_view layout, bool inverse) {
  auto out = RopeFunction::apply(q, k, positions, offsets, std::move(offset), cu_seqlens, base,
                                 rope_type, scaling, seq_len, rotary_dim, interleaved, layout,
                                 inverse);
  return {out[0], out[1]};
}

void rope_inplace_autograd(const at::Tensor& q, const std::optional<at::Tensor>& k,
                           const std::optional<at::Tensor>& positions,
                           const std::optional<at::Tensor>& offsets, c10::SymInt offset,
                           const std::optional<at::Tensor>& cu_seqlens, double base,
                           c10::string_view rope_type, at::ArrayRef<double> scaling,
                           int64_t seq_len, int64_t rotary_dim, bool interleaved,
                           c10::string_view layout, bool inverse) {
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (q.requires_grad() || (k.has_value() && k->requires_grad()));
  TORCH_CHECK(!needs_grad,
              "posenc: inplace=True rotates q and k in their own storage, which autograd cannot "
              "differentiate; use inplace=False for training, or run under torch.no_grad()");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    rope_inplace_op().call(q, k, positions, offsets, std::move(offset), cu_seqlens, base,
                           rope_type, scaling, seq_len, rotary_dim, interleaved, layout, inverse);
  }
  torch::autograd::impl::bump_version(q);
  if (k.has_value()) torch::autograd::impl::bump_version(*k);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("rope", &rope_autograd);
  m.impl("rope_", &rope_inplace_autograd);
}

}  // namespace ops
}  // namespace posenc
