// The pieces every autograd kernel of posenc shares. They are written as PyTorch writes its
// own ops' autograd kernels (the generated VariableType code): a torch::autograd::Node per op
// holds the backward formula, recorded with collect_next_edges / set_history, and the forward
// formula (forward-mode AD) sets the outputs' tangents at level 0. Unlike
// torch::autograd::Function, such a kernel composes with torch.func (grad, vjp, jvp, jacrev,
// jacfwd, hessian, vmap of each: functorch runs it once per transform level) and with
// torch.autograd.forward_ad, and it serves LibTorch's C++ autograd unchanged: one definition
// of each derivative for every front end.
//
// Rules every kernel keeps (each breaks a transform when forgotten):
// - the forward runs below autograd (AutoDispatchBelowADInplaceOrView);
// - a Node's apply calls ops through the dispatcher, with grad mode as it finds it, so that a
//   backward is itself differentiable (double backward, hessian, jacrev of jacrev);
// - a tangent is computed through the dispatcher too, grad mode as it is, never below
//   autograd or under no_grad (jacrev of jacfwd, grad of jvp and autograd.grad over
//   forward AD would silently get wrong numbers), from the primals (primal() below);
// - an in-place kernel refuses inputs that require grad or carry a tangent, and bumps the
//   versions of what it wrote (ADInplaceOrView is a fallthrough for custom ops).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace posenc {
namespace ops {
namespace autograd {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// How torch holds a Node: std::shared_ptr in torch 2.11 (deleted through deleteNode, which
// unwinds a long graph without recursion), c10::intrusive_ptr in torch 2.15 (the pointer type
// of an Edge's function says which, whatever the release). The library builds against either.
constexpr bool kSharedNodes =
    std::is_same_v<decltype(std::declval<torch::autograd::Edge&>().function), std::shared_ptr<Node>>;
template <class T>
using NodePtr = std::conditional_t<kSharedNodes, std::shared_ptr<T>, c10::intrusive_ptr<T>>;

// A new node of type T, held as torch holds nodes.
template <class T>
NodePtr<T> new_node() {
  if constexpr (kSharedNodes) {
    // deleteNode by argument-dependent lookup (n's base class is torch's Node): looked up only
    // where it exists, the torch versions that hold nodes by shared_ptr.
    return NodePtr<T>(new T(), [](T* n) { deleteNode(n); });
  } else {
    return c10::make_intrusive<T>();
  }
}

// The node of an op whose differentiable inputs are `inputs` (one edge each, in order: the
// gradients Node::apply returns), or a null one when none requires grad under grad mode.
template <class T, class... Inputs>
NodePtr<T> make_node(const Inputs&... inputs) {
  if (!torch::autograd::compute_requires_grad(inputs...)) return NodePtr<T>();
  NodePtr<T> node = new_node<T>();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  return node;
}

// Records `outputs` as the node's outputs (output i gets the gradient apply reads at i); node:
// make_node's (null: nothing recorded). Ptr, not NodePtr<T>: T cannot be deduced through the
// alias's conditional_t.
template <class Ptr, class... Outputs>
void record(const Ptr& node, const Outputs&... outputs) {
  if (node) torch::autograd::set_history(torch::autograd::flatten_tensor_args(outputs...), NodePtr<Node>(node));
}

// A tensor's tangent (forward AD, level 0: torch.func.jvp's too), undefined when it has none.
inline at::Tensor tangent(const at::Tensor& t) {
  return t.defined() ? t._fw_grad(/*level=*/0) : at::Tensor();
}
inline at::Tensor tangent(const std::optional<at::Tensor>& t) {
  return t.has_value() ? tangent(*t) : at::Tensor();
}
// Whether any of the tensors carries a tangent.
template <class... Tensors>
bool has_tangent(const Tensors&... tensors) {
  return (tangent(tensors).defined() || ...);
}
// A tensor's primal at level 0 (itself when it has no tangent). A forward formula reads the
// primals, as PyTorch's generated kernels do: a tangent computed from the dual tensors would
// carry a tangent of its own at the same level, which forward AD refuses. A view: backward
// still flows through it.
inline at::Tensor primal(const at::Tensor& t) {
  return tangent(t).defined() ? t._fw_primal(/*level=*/0) : t;
}

// The dtype out's tangent is carried in: out's, or the widest of the tangents of `inputs` it is
// computed from where that is wider (forward AD allows a float32 tangent of a float16 tensor,
// and torch's own ops carry it in float32: a tangent is never rounded to the output's dtype).
// A complex tangent (of a real primal: forward AD allows it) is refused, as the ops refuse a
// complex input (the formula's real arithmetic would drop its imaginary part).
template <class... Tensors>
at::ScalarType tangent_dtype(const at::Tensor& out, const Tensors&... inputs) {
  at::ScalarType dtype = out.scalar_type();
  const auto widen = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    TORCH_CHECK_TYPE(!at::isComplexType(t.scalar_type()),
                     "posenc: expected real floating-point tangents (forward AD), got a ", t.scalar_type(),
                     " tangent");
    dtype = at::promote_types(dtype, t.scalar_type());
  };
  (widen(tangent(inputs)), ...);
  return dtype;
}

// An op of (q, k?) applied to a pair (a, b) of gradients or tangents, either undefined (a
// zero one): the results, undefined where the input was. One call when both are defined and of
// one dtype; a lone b goes in as the op's q; two dtypes (forward AD allows a tangent of another
// floating dtype than its primal's) a call each, as the ops take a q and a k of one dtype.
// op(x, y) with y a std::optional<at::Tensor>, returning a tuple-like (out_x, out_y).
template <class Op>
std::pair<at::Tensor, at::Tensor> call_pair(const at::Tensor& a, const at::Tensor& b, const Op& op) {
  const auto alone = [&](const at::Tensor& x) { return std::get<0>(op(x, std::optional<at::Tensor>())); };
  if (!a.defined()) return {at::Tensor(), b.defined() ? alone(b) : at::Tensor()};
  if (!b.defined()) return {alone(a), at::Tensor()};
  if (b.scalar_type() != a.scalar_type()) return {alone(a), alone(b)};
  auto out = op(a, std::optional<at::Tensor>(b));
  return {std::get<0>(out), std::get<1>(out)};
}

// Sets out's tangent (an undefined one: none).
inline void set_tangent(const at::Tensor& out, const at::Tensor& t) {
  if (out.defined() && t.defined()) out._set_fw_grad(t, /*level=*/0, /*is_inplace_op=*/false);
}

// A saved optional tensor (an index tensor of the call), for the version check at backward.
inline SavedVariable save(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? SavedVariable(*t, /*is_output=*/false) : SavedVariable();
}
inline std::optional<at::Tensor> unpack(const SavedVariable& v) {
  at::Tensor t = v.unpack();
  return t.defined() ? std::optional<at::Tensor>(std::move(t)) : std::nullopt;
}

}  // namespace autograd
}  // namespace ops
}  // namespace posenc
