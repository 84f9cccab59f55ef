// qk_norm_rope and its backward composed of ATen ops and the rope op: the double backward
// (autograd differentiates this form: every op in it has a derivative, rope's its own), and
// the ATen fallback of devices without a qk_norm_rope kernel (aten_fallback.h). The norm's statistics in the compute dtype
// (float32, float64 for float64) as in the kernels; outputs rounded once to the inputs'
// dtypes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/aten_fallback.h"
#include "ops/qk_norm_rope/qk_norm_rope_call.h"

namespace posenc {
namespace ops {
namespace {

at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The norm's pieces of one operand, canonical (batch, seq, heads, head_dim), compute dtype.
struct Normed {
  at::Tensor r, xhat, w;  // w: effective weights broadcastable to x
};

Normed normalize(const QkNormRopeCall& c, const at::Tensor& x_in, const at::Tensor& weight) {
  const at::ScalarType acc = compute_dtype(c.rope.q);
  const at::Tensor x = rope_canonical_view(x_in, c.rope.layout).to(acc);
  const bool head = c.norm == QkNorm::kHead;
  const std::vector<int64_t> dims = head ? std::vector<int64_t>{-1} : std::vector<int64_t>{-2, -1};
  Normed n;
  n.r = at::rsqrt(x.square().mean(dims, /*keepdim=*/true) + c.eps);
  n.xhat = x * n.r;
  n.w = weight.to(acc) + c.weight_offset;
  if (!head) n.w = n.w.view({x.size(2), x.size(3)});
  return n;
}

RopeCall rope_of(const QkNormRopeCall& c, const at::Tensor& q, const at::Tensor& k, bool inverse) {
  RopeCall r = c.rope;
  r.q = q;
  r.k = k;
  if (inverse) r.inverse = !r.inverse;
  return r;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_composite(const QkNormRopeCall& c) {
  const Normed nq = normalize(c, c.rope.q, c.q_weight);
  const Normed nk = normalize(c, *c.rope.k, c.k_weight);
  const RopeLayout layout = c.rope.layout;
  auto [yq, yk] = call_rope(rope_of(c, rope_from_canonical(nq.xhat * nq.w, layout),
                                    rope_from_canonical(nk.xhat * nk.w, layout), false));
  return {yq.to(c.rope.q.scalar_type()), yk.to(c.rope.k->scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_backward_composite(
    const QkNormRopeCall& c) {
  const at::ScalarType acc = compute_dtype(c.rope.q);
  const RopeLayout layout = c.rope.layout;
  // The incoming gradients turned back (the transpose rotation).
  auto [guq, guk] = call_rope(rope_of(c, c.grad_q.to(acc), c.grad_k.to(acc), true));
  const bool head = c.norm == QkNorm::kHead;
  const std::vector<int64_t> dims = head ? std::vector<int64_t>{-1} : std::vector<int64_t>{-2, -1};
  auto one = [&](const at::Tensor& x, const at::Tensor& weight, const at::Tensor& gu_in) {
    const Normed n = normalize(c, x, weight);
    const at::Tensor gu = rope_canonical_view(gu_in, layout);
    const at::Tensor g = gu * n.w;
    const at::Tensor mean_gx = (g * n.xhat).mean(dims, /*keepdim=*/true);
    const at::Tensor dx = n.r * (g - n.xhat * mean_gx);
    const at::Tensor dw = head ? (gu * n.xhat).sum(at::IntArrayRef{0, 1, 2}) : (gu * n.xhat).sum(at::IntArrayRef{0, 1}).flatten();
    return std::make_pair(rope_from_canonical(dx, layout).to(x.scalar_type()),
                          dw.to(weight.scalar_type()));
  };
  auto [dq, dwq] = one(c.rope.q, c.q_weight, guq);
  auto [dk, dwk] = one(*c.rope.k, c.k_weight, guk);
  return {dq, dk, dwq, dwk};
}

namespace {

// The ATen fallback's boxed kernels: the same checks, then the composites.
template <bool kBackward>
void qk_norm_rope_fallback(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const QkNormRopeCall c = QkNormRopeCall::pop(*stack, kBackward);
  check_qk_norm_rope(c, kBackward);
  warn_aten_fallback(kBackward ? "qk_norm_rope_backward" : "qk_norm_rope", c.rope.q.device());
  if (!kBackward) {
    auto [q, k] = qk_norm_rope_composite(c);
    stack->emplace_back(std::move(q));
    stack->emplace_back(std::move(k));
    return;
  }
  auto [dq, dk, dwq, dwk] = qk_norm_rope_backward_composite(c);
  for (at::Tensor* t : {&dq, &dk, &dwq, &dwk}) stack->emplace_back(std::move(*t));
}

// qk_norm_rope_ on a device without a kernel: the same checks, the composite out of place,
// then copied into q and k.
void qk_norm_rope_inplace_fallback(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const QkNormRopeCall c = QkNormRopeCall::pop(*stack, /*backward=*/false);
  check_qk_norm_rope(c, /*backward=*/false);
  check_qk_norm_rope_inplace(c);
  warn_aten_fallback("qk_norm_rope_", c.rope.q.device());
  auto [q, k] = qk_norm_rope_composite(c);
  c.rope.q.copy_(q);
  c.rope.k->copy_(k);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("qk_norm_rope",
         torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_fallback<false>>());
  m.impl("qk_norm_rope_",
         torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_inplace_fallback>());
  m.impl("qk_norm_rope_backward",
         torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_fallback<true>>());
}

}  // namespace ops
}  // namespace posenc
