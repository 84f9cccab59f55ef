#include "ops/common/inference_only.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/variable.h>

namespace posenc {
namespace ops {

void inference_only_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  c10::SmallVector<at::Tensor, 4> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (!v.isTensor()) continue;
    TORCH_CHECK(!at::GradMode::is_enabled() || !v.toTensor().requires_grad(), "posenc: ",
                op.schema().name(), " has no autograd (it writes a KV cache, for inference); got ",
                args[i].name(), " that requires grad: call it under torch.no_grad() or "
                "torch.inference_mode(), or pass ", args[i].name(), ".detach()");
    TORCH_CHECK(!v.toTensor()._fw_grad(/*level=*/0).defined(), "posenc: ", op.schema().name(),
                " has no forward-mode AD (it writes a KV cache, for inference); got ", args[i].name(),
                " that carries a tangent (forward_ad / torch.func.jvp): pass its primal, ",
                "forward_ad.unpack_dual(", args[i].name(), ").primal");
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) written.push_back(v.toTensor());
  }
  {
    // Below autograd, as ATen's own kernels run after VariableType: the kernel's internal
    // views and calls skip the autograd and view-tracking layers (the versions of the tensors
    // it writes are bumped here).
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
}

}  // namespace ops
}  // namespace posenc
