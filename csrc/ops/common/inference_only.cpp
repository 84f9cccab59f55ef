#include "ops/common/inference_only.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>  // increment_version
#include <torch/csrc/autograd/variable.h>

#include <string>

namespace posenc {
namespace ops {

namespace {
// The written (a!) tensor arguments of `op` on `stack` (its arguments on top), None skipped.
c10::SmallVector<at::Tensor, 4> written_tensors(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  c10::SmallVector<at::Tensor, 4> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor() && args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) {
      written.push_back(v.toTensor());
    }
  }
  return written;
}

// The op's name without its namespace ("rope_", not "posenc::rope_"), for messages that start
// "posenc: ".
std::string op_name(const c10::OperatorHandle& op) {
  const std::string& full = op.schema().name();
  const size_t colons = full.rfind("::");
  return colons == std::string::npos ? full : full.substr(colons + 2);
}
}  // namespace

void inference_only_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (!v.isTensor()) continue;
    TORCH_CHECK(!at::GradMode::is_enabled() || !v.toTensor().requires_grad(), "posenc: ",
                op_name(op), " has no autograd (it writes a KV cache, for inference); got ",
                args[i].name(), " that requires grad: call it under torch.no_grad() or "
                "torch.inference_mode(), or pass ", args[i].name(), ".detach()");
    TORCH_CHECK(!v.toTensor()._fw_grad(/*level=*/0).defined(), "posenc: ", op_name(op),
                " has no forward-mode AD (it writes a KV cache, for inference); got ", args[i].name(),
                " that carries a tangent (forward_ad / torch.func.jvp): pass its primal, ",
                "forward_ad.unpack_dual(", args[i].name(), ").primal");
  }
  // Below autograd, as ATen's own kernels run after VariableType; ADInplaceOrView
  // (bump_written_versions) moves the versions of the tensors it writes.
  at::AutoDispatchBelowAutograd below;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

void bump_written_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                           torch::jit::Stack* stack) {
  const c10::SmallVector<at::Tensor, 4> written = written_tensors(op, *stack);
  const bool inference_mode = c10::InferenceMode::is_enabled();
  for (const at::Tensor& t : written) {
    TORCH_CHECK(inference_mode || !t.is_inference(), "posenc: ", op_name(op), " writes in place "
                "an inference tensor (made under torch.inference_mode()) outside inference mode, "
                "which is not allowed (as ATen's in-place ops refuse it); clone it first to get a "
                "normal tensor");
  }
  {
    // The kernel's internal views and calls skip the view-tracking layer, as ATen's do.
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) {
    if (!t.is_inference()) torch::autograd::increment_version(t);  // inference tensors have none
  }
}

template <c10::DispatchKey kKey>
void resolve_math_bits(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = (*stack)[first + i];
    if (!v.isTensor() || (!v.toTensor().is_neg() && !v.toTensor().is_conj())) continue;
    const bool written = args[i].alias_info() != nullptr && args[i].alias_info()->isWrite();
    TORCH_CHECK(!written, "posenc: ", op_name(op), ": expected ", args[i].name(), " without the ",
                v.toTensor().is_neg() ? "negative" : "conjugate", " bit (a view such as z.conj().imag), which ",
                "an op that writes ", args[i].name(), " in place cannot honour with its other writes; pass a ",
                "tensor without it (", args[i].name(), ".resolve_neg() is a copy: write the result back "
                "yourself)");
    v = v.toTensor().resolve_conj().resolve_neg();
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

template void resolve_math_bits<c10::DispatchKey::Negative>(const c10::OperatorHandle&, c10::DispatchKeySet,
                                                            torch::jit::Stack*);
template void resolve_math_bits<c10::DispatchKey::Conjugate>(const c10::OperatorHandle&, c10::DispatchKeySet,
                                                             torch::jit::Stack*);

}  // namespace ops
}  // namespace posenc
