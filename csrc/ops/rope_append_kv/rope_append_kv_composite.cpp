// rope_append_kv and rope_append_kv_ composed from ATen ops, for backends without a kernel of
// their own (the ATen fallback, ops/common/aten_fallback.h): the same checks, the rotation by
// the rope op of q's device (its kernel or its own fallback), then index_put_ of k and v into
// the cache rows. On the CPU the rows are checked before anything is written (IndexError), as
// the kernel's; elsewhere index_put_ refuses rows outside the cache. Slots -1 are left out.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/aten_fallback.h"
#include "ops/rope/rope_checks.h"
#include "ops/rope_append_kv/rope_append_kv_call.h"

namespace posenc {
namespace ops {
namespace {

void run_composite(torch::jit::Stack* stack, bool in_place) {
  const RopeAppendKvCall c = RopeAppendKvCall::pop(*stack);
  check_rope_append_kv(c);
  check_rope_append_kv_overlap(c, in_place);
  const at::Tensor& q = c.rope.q;
  warn_aten_fallback("rope_append_kv", q.device());
  const RopeCall r = c.rotation();
  const auto [q_rot, k_rot] = call_rope(r);
  const RopeLayout layout = c.rope.layout;
  const at::Tensor k_tokens = rope_canonical_view(k_rot, r.layout);  // (batch, seq, heads, d)
  const at::Tensor v_tokens = kv_token_view(c.v, layout);
  const at::Tensor kc = kv_cache_view(c.k_cache, layout);
  const at::Tensor vc = kv_cache_view(c.v_cache, layout);
  const int64_t batch = k_tokens.size(0), seq = k_tokens.size(1);
  const auto long_opts = q.options().dtype(at::kLong);
  // The rows' values on the host for the CPU's check (the kernel's own check).
  KvCacheArgs host;
  host.rope.batch = batch;
  host.rope.seq = seq;
  if (c.paged()) {
    const at::Tensor slots = c.slot_mapping->contiguous();
    if (slots.is_cpu()) {
      host.slot_mapping = slots.const_data_ptr<int64_t>();
      host.num_slots = kc.size(0) * kc.size(1);
      check_rope_append_kv_rows(host);
    }
    const at::Tensor keep = slots.ge(0).nonzero().squeeze(1);
    const at::Tensor kept = slots.index_select(0, keep);
    const at::Tensor block = kept.div(kc.size(1), "floor");
    const at::Tensor index = kept.remainder(kc.size(1));
    kc.index_put_({block, index}, k_tokens.select(0, 0).index_select(0, keep));
    vc.index_put_({block, index}, v_tokens.select(0, 0).index_select(0, keep));
  } else {
    const int64_t offset = c.rope.concrete_offset();
    at::Tensor first = at::full({batch}, offset, long_opts);
    if (c.rope.offsets.has_value()) first = first + *c.rope.offsets;
    if (first.is_cpu()) {
      const at::Tensor offsets = c.rope.offsets.has_value() ? c.rope.offsets->contiguous() : at::Tensor();
      host.offset = offset;
      host.offsets = offsets.defined() ? offsets.const_data_ptr<int64_t>() : nullptr;
      host.max_len = kc.size(1);
      check_rope_append_kv_rows(host);
    }
    const at::Tensor rows = first.unsqueeze(1) + at::arange(seq, long_opts).unsqueeze(0);
    const at::Tensor rows_b = at::arange(batch, long_opts).unsqueeze(1).expand({batch, seq});
    kc.index_put_({rows_b, rows}, k_tokens);
    vc.index_put_({rows_b, rows}, v_tokens);
  }
  if (in_place) {
    c.rope.q.copy_(q_rot.view_as(q));
    if (c.return_k) c.rope.k->copy_(k_rot.view_as(*c.rope.k));
    return;
  }
  stack->emplace_back(q_rot.view_as(q));
  stack->emplace_back(c.return_k ? k_rot.view_as(*c.rope.k) : at::empty({0}, q.options()));
}

void rope_append_kv_composite(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_composite(stack, /*in_place=*/false);
}

void rope_append_kv_inplace_composite(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  run_composite(stack, /*in_place=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("rope_append_kv", torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_composite>());
  m.impl("rope_append_kv_",
         torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_inplace_composite>());
}

}  // namespace ops
}  // namespace posenc
