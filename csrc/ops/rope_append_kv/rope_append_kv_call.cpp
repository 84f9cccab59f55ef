// rope_append_kv: the schemas, the reader of a boxed call, the launch preparation every
// backend shares, and the Autograd kernel (which refuses inputs that require grad).
#include "ops/rope_append_kv/rope_append_kv_call.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>

#include "ops/common/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

// The arguments between k and the RoPE tail: v, k_cache, v_cache, slot_mapping, return_k.
constexpr size_t kExtraArguments = 5;

size_t rope_argument_count() {
  size_t n = 0;
  RopeCall c;
  RopeCall::for_each_argument(c, [&](const char*, auto&) { ++n; });
  return n;
}

}  // namespace

RopeAppendKvCall RopeAppendKvCall::pop(torch::jit::Stack& stack) {
  static const size_t n = rope_argument_count() + kExtraArguments;
  TORCH_INTERNAL_ASSERT(stack.size() >= n, "posenc: rope_append_kv call with ", stack.size(),
                        " arguments on the stack, expected ", n);
  RopeAppendKvCall c;
  const size_t first = stack.size() - n + 2;  // after q, k
  c.v = stack[first].toTensor();
  c.k_cache = stack[first + 1].toTensor();
  c.v_cache = stack[first + 2].toTensor();
  if (!stack[first + 3].isNone()) c.slot_mapping = stack[first + 3].toTensor();
  c.return_k = stack[first + 4].toBool();
  stack.erase(stack.begin() + first, stack.begin() + first + kExtraArguments);
  c.rope = RopeCall::pop(stack);
  return c;
}

RopeCall RopeAppendKvCall::rotation() const {
  RopeCall r = rope;
  if (paged()) {
    r.q = rope.q.unsqueeze(0);
    r.k = rope.k->unsqueeze(0);
    r.layout = RopeLayout::kBSHD;
  }
  if (rope.positions.has_value()) {  // rotated at positions; offsets only place the rows
    r.offsets = std::nullopt;
    r.offset = 0;
  }
  return r;
}

at::Tensor kv_token_view(const at::Tensor& x, RopeLayout layout) {
  return rope_canonical_view(x, layout);  // "thd": unsqueeze(0)
}

at::Tensor kv_cache_view(const at::Tensor& cache, RopeLayout layout) {
  return layout == RopeLayout::kBHSD ? cache.transpose(1, 2) : cache;
}

namespace {

// q, k, then the five arguments of rope_append_kv, then the RoPE tail.
torch::jit::Stack push_call(const RopeAppendKvCall& c) {
  torch::jit::Stack stack;
  c.rope.push(stack);
  const c10::IValue extra[kExtraArguments] = {c.v, c.k_cache, c.v_cache, c.slot_mapping,
                                              c.return_k};
  stack.insert(stack.begin() + 2, std::begin(extra), std::end(extra));
  return stack;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> call_rope_append_kv(const RopeAppendKvCall& c) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("posenc::rope_append_kv", "");
  torch::jit::Stack stack = push_call(c);
  op.callBoxed(stack);
  return {stack[0].toTensor(), stack[1].toTensor()};
}

void call_rope_append_kv_inplace(const RopeAppendKvCall& c) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("posenc::rope_append_kv_", "");
  torch::jit::Stack stack = push_call(c);
  op.callBoxed(stack);
}

namespace {

void fill_strides(int64_t (&out)[4], const at::Tensor& t) {
  for (int d = 0; d < 4; ++d) out[d] = t.stride(d);
}

// The kernel parameters of a checked call.
KvLaunch prepare_kv_launch(const RopeAppendKvCall& c, int64_t rot, const at::Tensor& out_q,
                           const std::optional<at::Tensor>& out_k) {
  const RopeCall r = c.rotation();
  const auto as_rotated = [&](const at::Tensor& t) { return c.paged() ? t.unsqueeze(0) : t; };
  KvLaunch launch;
  // Without return_k the rotation's k output is k itself, never written (write_k false).
  launch.rope = prepare_rope_launch(r, rot, as_rotated(out_q),
                                    as_rotated(out_k.has_value() ? *out_k : *c.rope.k));
  KvCacheArgs& a = launch.args;
  a.rope = launch.rope.args;
  a.write_k = out_k.has_value();
  const at::Tensor v = kv_token_view(c.v, c.rope.layout);
  a.v = v.const_data_ptr();
  a.v_head_dim = v.size(3);
  fill_strides(a.v_stride, v);
  const at::Tensor kc = kv_cache_view(c.k_cache, c.rope.layout);
  const at::Tensor vc = kv_cache_view(c.v_cache, c.rope.layout);
  a.k_cache = kc.mutable_data_ptr();
  a.v_cache = vc.mutable_data_ptr();
  fill_strides(a.k_cache_stride, kc);
  fill_strides(a.v_cache_stride, vc);
  a.offset = c.rope.concrete_offset();
  if (c.rope.offsets.has_value()) {
    launch.offsets = c.rope.offsets->contiguous();
    a.offsets = launch.offsets.const_data_ptr<int64_t>();
  }
  if (c.slot_mapping.has_value()) {
    launch.slot_mapping = c.slot_mapping->contiguous();
    a.slot_mapping = launch.slot_mapping.const_data_ptr<int64_t>();
    a.block_size = kc.size(1);
    a.num_slots = kc.size(0) * kc.size(1);
  } else {
    a.max_len = kc.size(1);
  }
  return launch;
}

}  // namespace

void run_rope_append_kv_boxed(torch::jit::Stack* stack, bool in_place, KvOutputAllocator allocate,
                              KvKernelRunner run, bool check_rows) {
  const RopeAppendKvCall c = RopeAppendKvCall::pop(*stack);
  const int64_t rot = check_rope_append_kv(c);
  check_rope_append_kv_overlap(c, in_place);
  const at::Tensor out_q = in_place ? c.rope.q : allocate(c.rope.q);
  std::optional<at::Tensor> out_k;
  if (c.return_k) out_k = in_place ? *c.rope.k : allocate(*c.rope.k);
  const KvLaunch launch = prepare_kv_launch(c, rot, out_q, out_k);
  if (check_rows) check_rope_append_kv_rows(launch.args);  // before anything is written
  run(launch, c.rope.q);
  if (in_place) return;
  stack->emplace_back(out_q);
  stack->emplace_back(out_k.has_value() ? *out_k : at::empty({0}, c.rope.q.options()));
}

namespace {

// No autograd: the op writes a cache (inference). Under grad mode, an input that requires
// grad is an error naming it, rather than an output silently detached from the graph.
void no_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  // The tensors the op writes (the caches; q and k for rope_append_kv_): their version
  // counters move, as an ATen in-place op's do, so that autograd refuses a graph that saved
  // one of them before this write.
  c10::SmallVector<at::Tensor, 4> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (!v.isTensor()) continue;
    TORCH_CHECK(!at::GradMode::is_enabled() || !v.toTensor().requires_grad(), "posenc: ",
                op.schema().name(), " has no autograd (it writes a KV cache, for inference); got ",
                args[i].name(), " that requires grad: call it under torch.no_grad() or "
                "torch.inference_mode(), or pass ", args[i].name(), ".detach()");
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) written.push_back(v.toTensor());
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  const std::string tail = kRopeSchemaArguments;
  const std::string middle =
      "Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? slot_mapping=None, "
      "bool return_k=False, ";
  m.def(("rope_append_kv(Tensor q, Tensor k, " + middle + tail + ") -> (Tensor, Tensor)").c_str());
  m.def(("rope_append_kv_(Tensor(c!) q, Tensor(d!) k, " + middle + tail + ") -> ()").c_str());
}

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("rope_append_kv", torch::CppFunction::makeFromBoxedFunction<&no_autograd>());
  m.impl("rope_append_kv_", torch::CppFunction::makeFromBoxedFunction<&no_autograd>());
}

}  // namespace ops
}  // namespace posenc
