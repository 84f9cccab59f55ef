// The checks of a qk_norm_rope call (every backend, Meta included, rejects the same inputs
// with the same messages), its launch preparation and the boxed kernel body.
#include <c10/util/Exception.h>

#include <cmath>

#include "ops/qk_norm_rope/qk_norm_rope_call.h"
#include "ops/common/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

at::ScalarType compute_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A weight: 1-D, `expected` values (head_dim, or heads * head_dim for norm "hidden"), q's
// dtype (or float32 for half-precision q: float32 master weights), q's device.
void check_weight(const char* name, const at::Tensor& w, const at::Tensor& q,
                  const c10::SymInt& expected, QkNorm norm, const char* operand) {
  const bool reduced = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
  TORCH_CHECK_TYPE(w.scalar_type() == q.scalar_type() || (reduced && w.scalar_type() == at::kFloat),
                   "posenc: qk_norm_rope: expected ", name, " to have q's dtype ", q.scalar_type(),
                   reduced ? " (or torch.float32)" : "", ", got ", w.scalar_type());
  TORCH_CHECK(w.device() == q.device(), "posenc: qk_norm_rope: expected ", name,
              " on q's device ", q.device(), ", got ", name, " on ", w.device());
  TORCH_CHECK_VALUE(w.dim() == 1 && w.sym_size(0) == expected, "posenc: qk_norm_rope: expected ",
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
  TORCH_CHECK_VALUE(c.rope.k.has_value(), "posenc: qk_norm_rope: expected k, got None");
  const int64_t rot = check_rope_structure(c.rope);
  check_rope_settings(c.rope);
  TORCH_CHECK_VALUE(std::isfinite(c.eps) && c.eps > 0.0,
                    "posenc: qk_norm_rope: expected eps > 0 (added to the mean square), got ", c.eps);
  TORCH_CHECK_VALUE(std::isfinite(c.weight_offset),
                    "posenc: qk_norm_rope: expected weight_offset to be finite, got ",
                    c.weight_offset);
  const at::Tensor qv = rope_canonical_view(c.rope.q, c.rope.layout);
  const at::Tensor kv = rope_canonical_view(*c.rope.k, c.rope.layout);
  const bool head = c.norm == QkNorm::kHead;
  check_weight("q_weight", c.q_weight, c.rope.q, head ? qv.sym_size(3) : qv.sym_size(2) * qv.sym_size(3),
               c.norm, "q");
  check_weight("k_weight", c.k_weight, c.rope.q, head ? kv.sym_size(3) : kv.sym_size(2) * kv.sym_size(3),
               c.norm, "k");
  if (backward) {
    check_grad("grad_q", c.grad_q, c.rope.q, "q");
    check_grad("grad_k", c.grad_k, *c.rope.k, "k");
  }
  return rot;
}

namespace {

at::Tensor effective_weight(const at::Tensor& w, double offset, at::ScalarType acc) {
  at::Tensor out = w.to(acc);
  if (offset != 0.0) out = out.add(offset);
  return out.contiguous();
}

QkNormRopeLaunch prepare_qk_norm_rope_launch(const QkNormRopeCall& c, int64_t rot,
                                             const at::Tensor& out_q, const at::Tensor& out_k,
                                             bool backward) {
  QkNormRopeLaunch l;
  l.rope = prepare_rope_launch(c.rope, rot, out_q, out_k);
  QkNormRopeArgs& a = l.args;
  a.rope = l.rope.args;
  // The backward turns the incoming gradient back: the transpose rotation.
  if (backward) a.rope.inverse = !a.rope.inverse;
  const at::ScalarType acc = compute_dtype(c.rope.q);
  l.q_weight = effective_weight(c.q_weight, c.weight_offset, acc);
  l.k_weight = effective_weight(c.k_weight, c.weight_offset, acc);
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

}  // namespace ops
}  // namespace posenc
