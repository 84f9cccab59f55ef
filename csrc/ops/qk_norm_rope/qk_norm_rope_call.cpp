// QkNormRopeCall: the schemas of qk_norm_rope and its backward, and their one reader and
// writer. The RoPE arguments are RopeCall's own (RopeCall::pop / push); the norm's sit
// between k and the RoPE tail and are spliced out (in) around them.
#include "ops/qk_norm_rope/qk_norm_rope_call.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>

#include "posenc/math/qk_norm.h"

namespace posenc {
namespace ops {
namespace {

constexpr std::pair<QkNorm, const char*> kNorms[] = {
#define POSENC_X(e, name) {QkNorm::e, name},
    POSENC_QK_NORMS(POSENC_X)
#undef POSENC_X
};

// Arguments between k and the RoPE tail: q_weight, k_weight, eps, weight_offset, norm (and
// the gradients before them in the backward).
constexpr int kNormArguments = 5;
int extra_arguments(bool backward) { return kNormArguments + (backward ? 2 : 0); }

int rope_argument_count() {
  int n = 0;
  RopeCall c;
  RopeCall::for_each_argument(c, [&](const char*, auto&) { ++n; });
  return n;
}

c10::OperatorHandle find_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

}  // namespace

QkNorm parse_qk_norm(const std::string& name) {
  for (const auto& [value, n] : kNorms) {
    if (name == n) return value;
  }
  TORCH_CHECK_VALUE(false, "posenc: qk_norm_rope: unknown norm '", name,
                    "'; expected 'head' (each head's vector: Qwen3, Gemma 3) or 'hidden' (each "
                    "token's whole projection: OLMo 2)");
}

const char* qk_norm_name(QkNorm norm) {
  for (const auto& [value, n] : kNorms) {
    if (value == norm) return n;
  }
  return "?";
}

QkNormRopeCall QkNormRopeCall::pop(torch::jit::Stack& stack, bool backward) {
  static const int n_rope = rope_argument_count();
  const int extra = extra_arguments(backward);
  TORCH_INTERNAL_ASSERT(stack.size() >= static_cast<size_t>(n_rope + extra),
                        "posenc: qk_norm_rope call with ", stack.size(), " arguments");
  QkNormRopeCall c;
  const size_t first = stack.size() - n_rope - extra + 2;  // after q, k
  size_t i = first;
  if (backward) {
    c.grad_q = stack[i++].toTensor();
    c.grad_k = stack[i++].toTensor();
  }
  c.q_weight = stack[i++].toTensor();
  c.k_weight = stack[i++].toTensor();
  c.eps = stack[i++].toDouble();
  c.weight_offset = stack[i++].toDouble();
  c.norm = parse_qk_norm(stack[i++].toStringRef());
  stack.erase(stack.begin() + first, stack.begin() + first + extra);
  c.rope = RopeCall::pop(stack);
  return c;
}

void QkNormRopeCall::push(torch::jit::Stack& stack, bool backward) const {
  const size_t first = stack.size() + 2;  // after q, k
  rope.push(stack);
  std::vector<c10::IValue> extra;
  if (backward) {
    extra.emplace_back(grad_q);
    extra.emplace_back(grad_k);
  }
  extra.emplace_back(q_weight);
  extra.emplace_back(k_weight);
  extra.emplace_back(eps);
  extra.emplace_back(weight_offset);
  extra.emplace_back(std::string(qk_norm_name(norm)));
  stack.insert(stack.begin() + first, extra.begin(), extra.end());
}

std::tuple<at::Tensor, at::Tensor> call_qk_norm_rope(const QkNormRopeCall& call) {
  static const c10::OperatorHandle op = find_handle("posenc::qk_norm_rope");
  torch::jit::Stack stack;
  call.push(stack, /*backward=*/false);
  op.callBoxed(stack);
  return {stack[0].toTensor(), stack[1].toTensor()};
}

void call_qk_norm_rope_inplace(const QkNormRopeCall& call) {
  static const c10::OperatorHandle op = find_handle("posenc::qk_norm_rope_");
  torch::jit::Stack stack;
  call.push(stack, /*backward=*/false);
  op.callBoxed(stack);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_qk_norm_rope_backward(
    const QkNormRopeCall& call) {
  static const c10::OperatorHandle op = find_handle("posenc::qk_norm_rope_backward");
  torch::jit::Stack stack;
  call.push(stack, /*backward=*/true);
  op.callBoxed(stack);
  return {stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor(), stack[3].toTensor()};
}

// The ops:
//   qk_norm_rope           RMSNorm of q and k (per head, or per token's projection), scaled
//                          by weight + weight_offset, then RoPE exactly as rope with the same
//                          arguments; the norm in float32 (float64 for float64), the outputs
//                          in q's dtype, rounded once. (q, k).
//   qk_norm_rope_          the same, written into q and k (inference: no autograd).
//   qk_norm_rope_backward  (grad q, grad k, grad q_weight, grad k_weight) from the incoming
//                          gradients, in one pass (the gradient turned back, then RMSNorm's
//                          backward); the weight gradients in the weights' dtype.
TORCH_LIBRARY_FRAGMENT(posenc, m) {
  const std::string tail = kRopeSchemaArguments;
  m.def(("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps=1e-06, "
         "float weight_offset=0.0, str norm=\"head\", " + tail + ") -> (Tensor, Tensor)")
            .c_str());
  m.def(("qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, "
         "float eps=1e-06, float weight_offset=0.0, str norm=\"head\", " + tail + ") -> ()")
            .c_str());
  m.def(("qk_norm_rope_backward(Tensor q, Tensor k, Tensor grad_q, Tensor grad_k, "
         "Tensor q_weight, Tensor k_weight, float eps, float weight_offset, str norm, " + tail +
         ") -> (Tensor, Tensor, Tensor, Tensor)")
            .c_str());
}

}  // namespace ops
}  // namespace posenc
