// rope_append_kv and rope_append_kv_ composed from ATen ops, for backends without a kernel of
// their own (the ATen fallback, ops/common/aten_fallback.h): the same checks, the rotation by
// the rope op of q's device (its kernel or its own fallback), then the writes of k and v into
// the cache rows. One error contract with the kernels, and no host sync:
// - CPU index tensors are checked on the host before anything is written (IndexError, as the
//   kernel's check_rope_append_kv_rows: reading them costs nothing);
// - on a device the rows are not read back (nonzero or .item() would sync every call): a row
//   outside the cache fails on the device (at::_assert_async where the device has it, as the
//   CUDA kernel's assert, and an index outside the cache that makes index_put_ fail), and
//   slots -1 write nothing without being left out of the index (see write_paged).
// Two tokens for one slot: refused on the CPU; on a device the caller's error, the slot then
// holds an unspecified mix of them (index_put_ stores element by element), as on CUDA.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorOptions.h>
#include <torch/library.h>

#include "ops/common/aten_fallback.h"
#include "ops/common/rope_checks.h"
#include "ops/rope_append_kv/rope_append_kv_call.h"

namespace posenc {
namespace ops {
namespace {

// Fails on the device, without a host sync, unless every element of `ok` is true: through
// at::_assert_async where the device has a kernel for it (CPU, CUDA). Elsewhere the callers'
// out-of-range index is what fails.
void assert_all_on_device(const at::Tensor& ok, const char* message) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::_assert_async", "msg");
  const c10::DispatchKey key = c10::computeDispatchKey(std::nullopt, std::nullopt, ok.device());
  if (op.hasKernelForDispatchKey(key)) at::_assert_async(ok.all(), message);
}

// 0 .. n - 1 as int64 on like's device. Like every tensor made below, it comes from an op on
// the call's own tensors (new_empty, masked_fill rather than at::arange or at::where with a
// scalar, whose tensors a factory makes): a tensor subclass that stands for a device in the
// tests then sees every op (tests/python/test_rope_append_kv.py, OnDevice).
at::Tensor steps_like(const at::Tensor& like, int64_t n) {
  at::Tensor out = like.new_empty({n}, at::TensorOptions(at::kLong));  // like's device
  return at::arange_out(out, n);
}

// Tokens (tokens, heads, d) into the paged cache (num_blocks, block_size, heads, d) at
// `slots` (int64 (tokens,), -1: not written; validity checked by the caller). Without a mask
// and without reading a slot: every token writes, a -1 token into slot 0 the value slot 0
// ends with (that of the token writing it, or its current value), so whichever store wins
// slot 0 holds the same bits. A slot outside the cache gets block index num_blocks, which
// index_put_ refuses.
void write_paged(const at::Tensor& cache, const at::Tensor& tokens, const at::Tensor& slots,
                 const at::Tensor& unwritten, const at::Tensor& block, const at::Tensor& index) {
  const at::Tensor hits = slots.eq(0);
  const at::Tensor first = hits.to(at::kInt).argmax().view({1});  // 0 when no token hits
  const at::Tensor slot0 = at::where(hits.any(), tokens.index_select(0, first).squeeze(0),
                                     cache.select(0, 0).select(0, 0));
  const at::Tensor values = at::where(unwritten.view({-1, 1, 1}), slot0.unsqueeze(0), tokens);
  cache.index_put_({block, index}, values);
}

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
  // The rows' values on the host for the CPU's check (the kernel's own check).
  KvCacheArgs host;
  host.rope.batch = batch;
  host.rope.seq = seq;
  if (batch * seq == 0) {
    // Nothing to write (any offset or slot passes, as in the kernels).
  } else if (c.paged()) {
    const at::Tensor slots = c.slot_mapping->contiguous();
    const int64_t blocks = kc.size(0), block_size = kc.size(1);
    const int64_t num_slots = blocks * block_size;
    const at::Tensor unwritten = slots.eq(-1);
    if (slots.is_cpu()) {
      host.slot_mapping = slots.const_data_ptr<int64_t>();
      host.num_slots = num_slots;
      check_rope_append_kv_rows(host);
    } else {
      assert_all_on_device(unwritten.logical_or(slots.ge(0).logical_and(slots.lt(num_slots))),
                           "posenc: rope_append_kv: a slot_mapping value is out of range for the "
                           "cache (num_blocks * block_size slots; -1: not written)");
    }
    if (num_slots > 0) {  // else every slot is -1 (checked): nothing to write
      const at::Tensor valid = slots.ge(-1).logical_and(slots.lt(num_slots));
      const at::Tensor target = slots.masked_fill(unwritten, 0);
      const at::Tensor block = target.div(block_size, "floor").masked_fill_(valid.logical_not(), blocks);
      const at::Tensor index = target.remainder(block_size);
      write_paged(kc, k_tokens.select(0, 0), slots, unwritten, block, index);
      write_paged(vc, v_tokens.select(0, 0), slots, unwritten, block, index);
    }
  } else if (!c.rope.offsets.has_value()) {
    // Rows offset .. offset + seq - 1 of every batch row: known on the host, on any device.
    const int64_t offset = c.rope.concrete_offset();
    host.offset = offset;
    host.max_len = kc.size(1);
    check_rope_append_kv_rows(host);
    kc.narrow(1, offset, seq).copy_(k_tokens);
    vc.narrow(1, offset, seq).copy_(v_tokens);
  } else {
    const at::Tensor offsets = c.rope.offsets->contiguous();
    const int64_t offset = c.rope.concrete_offset(), max_len = kc.size(1);
    if (offsets.is_cpu()) {  // before the sums below, which huge offsets would wrap
      host.offset = offset;
      host.offsets = offsets.const_data_ptr<int64_t>();
      host.max_len = max_len;
      check_rope_append_kv_rows(host);
    }
    at::Tensor rows = (offsets + offset).unsqueeze(1) + steps_like(offsets, seq).unsqueeze(0);
    if (!offsets.is_cpu()) {
      // The kernels' checks: offsets within [-2**53, 2**53] (their sums cannot wrap), rows
      // within the cache. A row outside gets index max_len, which index_put_ refuses (a
      // negative one would wrap around to the cache's end).
      const at::Tensor ok = offsets.ge(-kRopeMaxPosition)
                                .logical_and(offsets.le(kRopeMaxPosition))
                                .unsqueeze(1)
                                .logical_and(rows.ge(0))
                                .logical_and(rows.lt(max_len));
      assert_all_on_device(ok, "posenc: rope_append_kv: a batch row writes cache rows out of "
                               "range for max_len (offset + its cache length so far .. + seq - 1), "
                               "or its offset is outside [-2**53, 2**53]");
      rows = rows.masked_fill(ok.logical_not(), max_len);
    }
    const at::Tensor rows_b = steps_like(offsets, batch).unsqueeze(1).expand({batch, seq});
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
