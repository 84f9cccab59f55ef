// The qk_norm_rope op family's host side (RMSNorm of q and k, then RoPE; see qk_norm_rope.h):
// the schemas of qk_norm_rope, qk_norm_rope_ and qk_norm_rope_backward and QkNormRopeCall's
// one reader and writer; the checks (every backend, Meta included, rejects the same inputs
// with the same messages), the launch preparation and the boxed kernel body; the Meta
// kernels; the ATen composite; the CPU and CUDA registrations. The autograd is in
// autograd.cpp, the CUDA kernels in cuda/qk_norm_rope/qk_norm_rope.cu.
#include "ops/qk_norm_rope/qk_norm_rope.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ops/common/aten_fallback.h"
#include "ops/common/op_handles.h"
#include "ops/common/py_format.h"
#include "ops/common/cpu/cpu_support.h"
#include "ops/common/meta_support.h"
#include "ops/common/rope_checks.h"
#include "ops/qk_norm_rope/cpu/kernel.h"
#include "posenc/math/qk_norm.h"

namespace posenc {
namespace ops {
namespace {

// The norm's compute dtype, float32 (float64 for float64 inputs): the kernels' effective
// weights and the composite's statistics.
at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

// ---- QkNormRopeCall: the schemas of qk_norm_rope and its backward, and their one reader
// and writer. The RoPE arguments are RopeCall's own (RopeCall::pop / push); the norm's sit
// between k and the RoPE tail and are spliced out (in) around them.
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
  const int n_rope = RopeCall::argument_count();
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
  c.rope.require_k(backward ? "qk_norm_rope_backward" : "qk_norm_rope");
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
  static const c10::OperatorHandle op = find_boxed_op("posenc::qk_norm_rope");
  torch::jit::Stack stack;
  call.push(stack, /*backward=*/false);
  op.callBoxed(stack);
  return {stack[0].toTensor(), stack[1].toTensor()};
}

void call_qk_norm_rope_inplace(const QkNormRopeCall& call) {
  static const c10::OperatorHandle op = find_boxed_op("posenc::qk_norm_rope_");
  torch::jit::Stack stack;
  call.push(stack, /*backward=*/false);
  op.callBoxed(stack);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_qk_norm_rope_backward(
    const QkNormRopeCall& call) {
  static const c10::OperatorHandle op = find_boxed_op("posenc::qk_norm_rope_backward");
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
  const std::string settings = kQkNormSchemaSettings;
  m.def(("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, " + settings + ", " +
         tail + ") -> (Tensor, Tensor)")
            .c_str());
  m.def(("qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, " + settings +
         ", " + tail + ") -> ()")
            .c_str());
  m.def(("qk_norm_rope_backward(Tensor q, Tensor k, Tensor grad_q, Tensor grad_k, "
         "Tensor q_weight, Tensor k_weight, float eps, float weight_offset, str norm, " + tail +
         ") -> (Tensor, Tensor, Tensor, Tensor)")
            .c_str());
}

// ---- The checks of a call (every backend, Meta included, rejects the same inputs with the
// same messages), its launch preparation and the boxed kernel body.
namespace {

// A weight: 1-D, `expected` values (head_dim, or heads * head_dim for norm "hidden"), q's
// dtype (or float32 for half-precision q: float32 master weights), q's device.
void check_weight(const char* op, const char* name, const at::Tensor& w, const at::Tensor& q,
                  const c10::SymInt& expected, QkNorm norm, const char* operand) {
  const bool reduced = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
  TORCH_CHECK_TYPE(w.scalar_type() == q.scalar_type() || (reduced && w.scalar_type() == at::kFloat),
                   "posenc: ", op, ": expected ", name, " to have q's dtype ", py_dtype(q.scalar_type()),
                   reduced ? " (or torch.float32)" : "", ", got ", py_dtype(w.scalar_type()));
  TORCH_CHECK(w.device() == q.device(), "posenc: ", op, ": expected ", name,
              " on q's device ", q.device(), ", got ", name, " on ", w.device());
  TORCH_CHECK_VALUE(w.dim() == 1 && w.sym_size(0) == expected, "posenc: ", op, ": expected ",
                    name, " of shape (", expected, ",) (",
                    norm == QkNorm::kHead ? "head_dim, for norm 'head'"
                                          : "heads * head_dim of ",
                    norm == QkNorm::kHead ? "" : operand,
                    norm == QkNorm::kHead ? "" : ", for norm 'hidden'", "), got shape ",
                    w.sym_sizes());
}

void check_grad(const char* name, const at::Tensor& g, const at::Tensor& x, const char* xname) {
  TORCH_CHECK(g.sym_sizes() == x.sym_sizes(), "posenc: qk_norm_rope_backward: expected ", name,
              " of ", xname, "'s shape ", x.sym_sizes(), ", got ", g.sym_sizes());
  TORCH_CHECK_TYPE(g.scalar_type() == x.scalar_type(), "posenc: qk_norm_rope_backward: expected ",
                   name, " to have dtype ", x.scalar_type(), ", got ", g.scalar_type());
  TORCH_CHECK(g.device() == x.device(), "posenc: qk_norm_rope_backward: expected ", name, " on ",
              x.device(), ", got ", g.device());
}

}  // namespace

int64_t check_qk_norm_rope(const QkNormRopeCall& c, bool backward) {
  const int64_t rot = check_rope_structure(c.rope);
  check_rope_settings(c.rope);
  TORCH_CHECK_VALUE(std::isfinite(c.eps) && c.eps > 0.0,
                    "posenc: ", c.op, ": expected eps > 0 (added to the mean square), got ", c.eps);
  // The mean square and eps are float32 below float64: an eps that rounds to 0 there, or a
  // subnormal one that flush-to-zero makes 0 (torch.set_flush_denormal), would turn an
  // all-zero head into 0 * rsqrt(0) = NaN. So eps is at least the compute dtype's smallest
  // normal number.
  const bool f64 = c.rope.q.scalar_type() == at::kDouble;
  TORCH_CHECK_VALUE(f64 ? c.eps >= std::numeric_limits<double>::min()
                        : static_cast<float>(c.eps) >= std::numeric_limits<float>::min(),
                    "posenc: ", c.op, ": expected eps >= ", f64 ? "2.2250738585072014e-308" : "1.1754943508222875e-38",
                    " (the smallest normal number of ", f64 ? "float64" : "float32", ", in which the norm of ",
                    py_dtype(c.rope.q.scalar_type()), " q and k is computed), got ", c.eps);
  // Finite in the compute dtype too (1e39 is finite in float64, inf in float32: NaN outputs).
  TORCH_CHECK_VALUE(f64 ? std::isfinite(c.weight_offset) : std::isfinite(static_cast<float>(c.weight_offset)),
                    "posenc: ", c.op, ": expected weight_offset to be finite", f64 ? "" : " in float32",
                    " (the norm of ", py_dtype(c.rope.q.scalar_type()), " q and k is computed in ",
                    f64 ? "float64" : "float32", "), got ", c.weight_offset);
  const at::Tensor qv = rope_canonical_view(c.rope.q, c.rope.layout);
  const at::Tensor kv = rope_canonical_view(*c.rope.k, c.rope.layout);
  const bool head = c.norm == QkNorm::kHead;
  check_weight(c.op, "q_weight", c.q_weight, c.rope.q, head ? qv.sym_size(3) : qv.sym_size(2) * qv.sym_size(3),
               c.norm, "q");
  check_weight(c.op, "k_weight", c.k_weight, c.rope.q, head ? kv.sym_size(3) : kv.sym_size(2) * kv.sym_size(3),
               c.norm, "k");
  if (backward) {
    check_grad("grad_q", c.grad_q, c.rope.q, "q");
    check_grad("grad_k", c.grad_k, *c.rope.k, "k");
  }
  return rot;
}

at::Tensor qk_norm_effective_weight(const at::Tensor& w, double offset, const at::Tensor& q) {
  at::Tensor out = w.to(compute_dtype(q));
  if (offset != 0.0) out = out.add(offset);
  return out.contiguous();
}

namespace {

QkNormRopeLaunch prepare_qk_norm_rope_launch(const QkNormRopeCall& c, int64_t rot,
                                             const at::Tensor& out_q, const at::Tensor& out_k,
                                             bool backward) {
  QkNormRopeLaunch l;
  l.rope = prepare_rope_launch(c.rope, rot, out_q, out_k);
  QkNormRopeArgs& a = l.args;
  a.rope = l.rope.args;
  // The backward turns the incoming gradient back: the transpose rotation.
  if (backward) a.rope.inverse = !a.rope.inverse;
  l.q_weight = qk_norm_effective_weight(c.q_weight, c.weight_offset, c.rope.q);
  l.k_weight = qk_norm_effective_weight(c.k_weight, c.weight_offset, c.rope.q);
  a.q_weight = l.q_weight.const_data_ptr();
  a.k_weight = l.k_weight.const_data_ptr();
  a.eps = c.eps;
  a.norm = c.norm;
  if (backward) {
    l.grad_q = rope_canonical_view(c.grad_q, c.rope.layout);
    l.grad_k = rope_canonical_view(c.grad_k, c.rope.layout);
    fill_rope_operand(a.grad_q, l.grad_q, l.grad_q);
    fill_rope_operand(a.grad_k, l.grad_k, l.grad_k);
  }
  return l;
}

}  // namespace

void check_qk_norm_rope_inplace(const QkNormRopeCall& c) {
  const RopeCall& r = c.rope;
  const auto optional = [](const std::optional<at::Tensor>& t) { return t ? &*t : nullptr; };
  check_written_memory("qk_norm_rope_", {{"q", &r.q}, {"k", &*r.k}},
                       {{"q_weight", &c.q_weight}, {"k_weight", &c.k_weight},
                        {"positions", optional(r.positions)}, {"offset", optional(r.offsets)},
                        {"cu_seqlens", optional(r.cu_seqlens)}},
                       "pass copies or use inplace=False");
}

void run_qk_norm_rope_boxed(torch::jit::Stack* stack, bool backward,
                            QkNormRopeAllocator allocate, QkNormRopeRunner run) {
  const QkNormRopeCall c = QkNormRopeCall::pop(*stack, backward);
  const int64_t rot = check_qk_norm_rope(c, backward);
  at::Tensor out_q = allocate(c.rope.q);
  at::Tensor out_k = allocate(*c.rope.k);
  QkNormRopeLaunch l = prepare_qk_norm_rope_launch(c, rot, out_q, out_k, backward);
  run(l, c.rope.q, backward);
  stack->emplace_back(std::move(out_q));
  stack->emplace_back(std::move(out_k));
  if (backward) {
    stack->emplace_back(l.q_weight_grad.to(c.q_weight.scalar_type()));
    stack->emplace_back(l.k_weight_grad.to(c.k_weight.scalar_type()));
  }
}

void run_qk_norm_rope_inplace_boxed(torch::jit::Stack* stack, QkNormRopeRunner run) {
  const QkNormRopeCall c = QkNormRopeCall::pop(*stack, /*backward=*/false);
  const int64_t rot = check_qk_norm_rope(c, /*backward=*/false);
  check_qk_norm_rope_inplace(c);
  // Each kernel reads a normalised vector whole (its sum of squares) before it writes it, and
  // writes every feature from the thread that read it: q and k can be their own outputs.
  QkNormRopeLaunch l = prepare_qk_norm_rope_launch(c, rot, c.rope.q, *c.rope.k, /*backward=*/false);
  run(l, c.rope.q, /*backward=*/false);
}

// ---- Meta kernels of qk_norm_rope and its backward: the real kernels' checks, and the
// outputs' shapes and strides as the backends allocate them (like q and k, like the
// weights), with symbolic sizes, so torch.compile and torch.export trace them without
// running them.
namespace {

template <bool kBackward>
void qk_norm_rope_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const QkNormRopeCall c = QkNormRopeCall::pop(*stack, kBackward);
  const char* op = kBackward ? "qk_norm_rope_backward" : "qk_norm_rope";
  check_not_mixed_with_meta(op, {{"q", &c.rope.q}, {"k", optional_ptr(c.rope.k)},
                                 {"q_weight", &c.q_weight}, {"k_weight", &c.k_weight},
                                 {"grad_q", &c.grad_q}, {"grad_k", &c.grad_k},
                                 {"positions", optional_ptr(c.rope.positions)},
                                 {"offsets", optional_ptr(c.rope.offsets)},
                                 {"cu_seqlens", optional_ptr(c.rope.cu_seqlens)}});
  check_qk_norm_rope(c, kBackward);
  stack->emplace_back(at::empty_like(c.rope.q));
  stack->emplace_back(at::empty_like(*c.rope.k));
  if (kBackward) {
    stack->emplace_back(at::empty_like(c.q_weight, at::MemoryFormat::Contiguous));
    stack->emplace_back(at::empty_like(c.k_weight, at::MemoryFormat::Contiguous));
  }
}

// qk_norm_rope_: the checks only, the in-place proof included (it reads strides, not data).
void qk_norm_rope_inplace_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const QkNormRopeCall c = QkNormRopeCall::pop(*stack, /*backward=*/false);
  check_not_mixed_with_meta("qk_norm_rope_", {{"q", &c.rope.q}, {"k", optional_ptr(c.rope.k)},
                                              {"q_weight", &c.q_weight}, {"k_weight", &c.k_weight},
                                              {"positions", optional_ptr(c.rope.positions)},
                                              {"offsets", optional_ptr(c.rope.offsets)},
                                              {"cu_seqlens", optional_ptr(c.rope.cu_seqlens)}});
  check_qk_norm_rope(c, /*backward=*/false);
  check_qk_norm_rope_inplace(c);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("qk_norm_rope_", torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_inplace_meta>());
  m.impl("qk_norm_rope", torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_meta<false>>());
  m.impl("qk_norm_rope_backward",
         torch::CppFunction::makeFromBoxedFunction<&qk_norm_rope_meta<true>>());
}

// ---- qk_norm_rope and its backward composed of ATen ops and the rope op: the double
// backward (autograd differentiates this form: every op in it has a derivative, rope's its
// own), and the ATen fallback of devices without a qk_norm_rope kernel (aten_fallback.h).
// The norm's statistics in the compute dtype (float32, float64 for float64) as in the
// kernels; outputs rounded once to the inputs' dtypes.
namespace {

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

// RMSNorm's Jacobian applied to v (canonical, compute dtype): d(xhat)/dx = r (I - xhat xhat^T / D)
// with D the normalised features (the head's, or the token's whole projection). It is
// symmetric, so this one product both turns a gradient back (the backward composite) and
// carries a tangent forward (qk_norm_tangent): dxhat = r dx - x r^3 mean(x dx).
at::Tensor norm_jacobian(const QkNormRopeCall& c, const Normed& n, const at::Tensor& v) {
  const bool head = c.norm == QkNorm::kHead;
  const std::vector<int64_t> dims = head ? std::vector<int64_t>{-1} : std::vector<int64_t>{-2, -1};
  return n.r * (v - n.xhat * (v * n.xhat).mean(dims, /*keepdim=*/true));
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
  auto one = [&](const at::Tensor& x, const at::Tensor& weight, const at::Tensor& gu_in) {
    const Normed n = normalize(c, x, weight);
    const at::Tensor gu = rope_canonical_view(gu_in, layout);
    const at::Tensor dx = norm_jacobian(c, n, gu * n.w);
    const at::Tensor dw = head ? (gu * n.xhat).sum(at::IntArrayRef{0, 1, 2}) : (gu * n.xhat).sum(at::IntArrayRef{0, 1}).flatten();
    return std::make_pair(rope_from_canonical(dx, layout).to(x.scalar_type()),
                          dw.to(weight.scalar_type()));
  };
  auto [dq, dwq] = one(c.rope.q, c.q_weight, guq);
  auto [dk, dwk] = one(*c.rope.k, c.k_weight, guk);
  return {dq, dk, dwq, dwk};
}

at::Tensor qk_norm_tangent(const QkNormRopeCall& c, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& tx, const at::Tensor& tw) {
  if (!tx.defined() && !tw.defined()) return at::Tensor();
  const at::ScalarType acc = compute_dtype(c.rope.q);
  const RopeLayout layout = c.rope.layout;
  const Normed n = normalize(c, x, weight);
  at::Tensor u;
  if (tx.defined()) u = norm_jacobian(c, n, rope_canonical_view(tx, layout).to(acc)) * n.w;
  if (tw.defined()) {
    at::Tensor dw = tw.to(acc);
    if (c.norm != QkNorm::kHead) dw = dw.view_symint({n.xhat.sym_size(2), n.xhat.sym_size(3)});
    u = u.defined() ? u + n.xhat * dw : n.xhat * dw;
  }
  return rope_from_canonical(u, layout);
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

// ---- CPU backend of qk_norm_rope and its backward: the shared boxed body above with
// outputs from empty_output_like (cpu_support.h), and the vectorised kernel of
// cpu/kernel.cpp (one build per vector ISA, chosen at run time).
namespace {

void run_qk_norm_rope_cpu(QkNormRopeLaunch& l, const at::Tensor& q, bool backward) {
  int64_t chunks = 0;
  if (backward) {
    // Per-chunk partial sums of the weight gradients (compute dtype); row 0 holds the total.
    chunks = std::max<int64_t>(1, cpu::qk_norm_chunks(l.args.rope.batch * l.args.rope.seq));
    l.q_weight_grad = at::zeros({chunks, l.q_weight.size(0)}, l.q_weight.options());
    l.k_weight_grad = at::zeros({chunks, l.k_weight.size(0)}, l.k_weight.options());
    l.args.q_weight_grad = l.q_weight_grad.mutable_data_ptr();
    l.args.k_weight_grad = l.k_weight_grad.mutable_data_ptr();
  }
  cpu::qk_norm_rope_stub::get()(l.args, q.scalar_type(), backward, chunks);
  if (backward) {
    l.q_weight_grad = l.q_weight_grad[0];
    l.k_weight_grad = l.k_weight_grad[0];
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("qk_norm_rope", torch::CppFunction::makeFromBoxedFunction<
                             &qk_norm_rope_kernel_boxed<&empty_output_like, &run_qk_norm_rope_cpu>>());
  m.impl("qk_norm_rope_", torch::CppFunction::makeFromBoxedFunction<
                              &qk_norm_rope_inplace_kernel_boxed<&run_qk_norm_rope_cpu>>());
  m.impl("qk_norm_rope_backward",
         torch::CppFunction::makeFromBoxedFunction<
             &qk_norm_rope_backward_kernel_boxed<&empty_output_like, &run_qk_norm_rope_cpu>>());
}

}  // namespace ops
}  // namespace posenc

// ---- CUDA backend: the same boxed bodies with outputs from empty_like, and the launches of
// cuda/qk_norm_rope/qk_norm_rope.cu's kernels on q's device and current stream (the
// backward's partial-sum rows from torch's allocator).
#if defined(POSENC_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/qk_norm_rope/launch.h"

namespace posenc {
namespace ops {
namespace {

void run_qk_norm_rope_cuda(QkNormRopeLaunch& l, const at::Tensor& q, bool backward) {
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t lq = l.q_weight.size(0), lk = l.k_weight.size(0);
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "posenc_qk_norm_rope_cuda", [&] {
    if (!backward) {
      C10_CUDA_CHECK(launch_qk_norm_rope<scalar_t>(l.args, stream));
      return;
    }
    // Without tokens or weights (then q and k have no element either: dx is empty), the
    // weight gradients are zeros, as on the CPU.
    int64_t n_rows = 0;
    C10_CUDA_CHECK(qk_norm_rope_backward_rows<scalar_t>(l.args, lq, lk, &n_rows));
    if (n_rows == 0) {
      l.q_weight_grad = at::zeros({lq}, l.q_weight.options());
      l.k_weight_grad = at::zeros({lk}, l.k_weight.options());
      return;
    }
    const int64_t row_len = 2 * std::max(lq, lk);
    at::Tensor rows = at::zeros({n_rows, row_len}, l.q_weight.options());
    at::Tensor sums = at::empty({row_len}, l.q_weight.options());
    C10_CUDA_CHECK(launch_qk_norm_rope_backward<scalar_t>(l.args, rows.mutable_data_ptr(), n_rows, row_len,
                                                          sums.mutable_data_ptr(), stream));
    l.q_weight_grad = sums.narrow(0, 0, lq);
    l.k_weight_grad = sums.narrow(0, row_len / 2, lk);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("qk_norm_rope", torch::CppFunction::makeFromBoxedFunction<
                             &qk_norm_rope_kernel_boxed<&empty_like_input, &run_qk_norm_rope_cuda>>());
  // In place: each warp reads its vector whole (the sum of squares, a warp-wide shuffle)
  // before any lane writes, and each lane writes only the features it read.
  m.impl("qk_norm_rope_", torch::CppFunction::makeFromBoxedFunction<
                              &qk_norm_rope_inplace_kernel_boxed<&run_qk_norm_rope_cuda>>());
  m.impl("qk_norm_rope_backward",
         torch::CppFunction::makeFromBoxedFunction<
             &qk_norm_rope_backward_kernel_boxed<&empty_like_input, &run_qk_norm_rope_cuda>>());
}

}  // namespace ops
}  // namespace posenc
#endif  // POSENC_WITH_CUDA
