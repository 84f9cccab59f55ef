// rope_append_kv / rope_append_kv_, the whole op but its kernels (cpu/kernel.cpp,
// cuda/rope_append_kv/rope_append_kv.cu): the schemas, the reader of a boxed call, the
// argument checks, the launch preparation every backend shares, the Autograd kernel (which
// refuses inputs that require grad), the Meta kernels, the ATen composite and the CPU and
// CUDA registrations.
#include "ops/rope_append_kv/rope_append_kv.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "ops/common/aten_fallback.h"
#include "ops/common/op_handles.h"
#include "ops/common/cpu/cpu_support.h"
#include "ops/common/inference_only.h"
#include "ops/common/meta_support.h"
#include "ops/common/rope_checks.h"
#include "ops/rope_append_kv/cpu/kernel.h"

namespace posenc {
namespace ops {

// ---- The call: its reader, its views, the boxed calls of the C++ API

namespace {

// The arguments between k and the RoPE tail: v, k_cache, v_cache, slot_mapping, return_k,
// k_scale, v_scale, q_weight, k_weight, eps, weight_offset, norm.
constexpr size_t kExtraArguments = 12;

}  // namespace

RopeAppendKvCall RopeAppendKvCall::pop(torch::jit::Stack& stack) {
  const size_t n = static_cast<size_t>(RopeCall::argument_count()) + kExtraArguments;
  TORCH_INTERNAL_ASSERT(stack.size() >= n, "posenc: rope_append_kv call with ", stack.size(),
                        " arguments on the stack, expected ", n);
  RopeAppendKvCall c;
  const size_t first = stack.size() - n + 2;  // after q, k
  c.v = stack[first].toTensor();
  c.k_cache = stack[first + 1].toTensor();
  c.v_cache = stack[first + 2].toTensor();
  c.slot_mapping = optional_tensor(stack[first + 3]);
  c.return_k = stack[first + 4].toBool();
  c.k_scale = optional_tensor(stack[first + 5]);
  c.v_scale = optional_tensor(stack[first + 6]);
  c.q_weight = optional_tensor(stack[first + 7]);
  c.k_weight = optional_tensor(stack[first + 8]);
  c.eps = stack[first + 9].toDouble();
  c.weight_offset = stack[first + 10].toDouble();
  c.norm = parse_qk_norm(stack[first + 11].toStringRef());
  stack.erase(stack.begin() + first, stack.begin() + first + kExtraArguments);
  c.rope = RopeCall::pop(stack);
  c.rope.require_k("rope_append_kv");
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

QkNormRopeCall RopeAppendKvCall::normed_rotation() const {
  QkNormRopeCall n;
  n.rope = rotation();
  n.q_weight = *q_weight;
  n.k_weight = *k_weight;
  n.eps = eps;
  n.weight_offset = weight_offset;
  n.norm = norm;
  n.op = "rope_append_kv";
  return n;
}

at::Tensor kv_token_view(const at::Tensor& x, RopeLayout layout) {
  return rope_canonical_view(x, layout);  // "thd": unsqueeze(0)
}

at::Tensor kv_cache_view(const at::Tensor& cache, RopeLayout layout) {
  return layout == RopeLayout::kBHSD ? cache.transpose(1, 2) : cache;
}

namespace {

// q, k, then the seven arguments of rope_append_kv, then the RoPE tail.
torch::jit::Stack push_call(const RopeAppendKvCall& c) {
  torch::jit::Stack stack;
  c.rope.push(stack);
  const c10::IValue extra[kExtraArguments] = {
      c.v, c.k_cache, c.v_cache, optional_tensor_ivalue(c.slot_mapping), c.return_k,
      optional_tensor_ivalue(c.k_scale), optional_tensor_ivalue(c.v_scale), optional_tensor_ivalue(c.q_weight),
      optional_tensor_ivalue(c.k_weight), c.eps,
      c.weight_offset, std::string(qk_norm_name(c.norm))};
  stack.insert(stack.begin() + 2, std::begin(extra), std::end(extra));
  return stack;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> call_rope_append_kv(const RopeAppendKvCall& c) {
  static const c10::OperatorHandle op = find_boxed_op("posenc::rope_append_kv");
  torch::jit::Stack stack = push_call(c);
  op.callBoxed(stack);
  return {stack[0].toTensor(), stack[1].toTensor()};
}

void call_rope_append_kv_inplace(const RopeAppendKvCall& c) {
  // Without return_k, the overload whose schema leaves k unwritten (kKeepK).
  static const c10::OperatorHandle writes_k = find_boxed_op("posenc::rope_append_kv_");
  static const c10::OperatorHandle keeps_k = find_boxed_op("posenc::rope_append_kv_", kKeepK);
  torch::jit::Stack stack = push_call(c);
  (c.return_k ? writes_k : keeps_k).callBoxed(stack);
}

void check_keep_k_overload(const c10::OperatorHandle& op, const RopeAppendKvCall& c) {
  TORCH_CHECK_VALUE(!c.return_k || op.schema().overload_name() != kKeepK,
                    "posenc: rope_append_kv_.", kKeepK, " leaves k as it is (its schema does not write k): "
                    "expected return_k=False, got True (rope_append_kv_ writes the rotated k into k)");
}

// ---- Checks
// The rotation's are RoPE's own (check_rope_structure and check_rope_settings on
// RopeAppendKvCall::rotation); these add v, the caches, slot_mapping, and the values of the
// rows written. Each message names the argument.

namespace {

const char* cache_shape(RopeLayout layout, bool v) {
  switch (layout) {
    case RopeLayout::kBHSD:
      return v ? "(batch, kv_heads, max_len, v_head_dim)" : "(batch, kv_heads, max_len, head_dim)";
    case RopeLayout::kTHD:
      return v ? "(num_blocks, block_size, kv_heads, v_head_dim)"
               : "(num_blocks, block_size, kv_heads, head_dim)";
    default:
      return v ? "(batch, max_len, kv_heads, v_head_dim)" : "(batch, max_len, kv_heads, head_dim)";
  }
}

void check_same_device(const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(t.device() == q.device(), "posenc: rope_append_kv: expected ", name,
              " on q's device ", q.device(), ", got ", name, " on ", t.device());
}

// One cache against the new tokens (x: k or v as (batch, seq, heads, head_dim)): of x's dtype,
// or FP8 (then x is float32, bfloat16 or float16: its values are rotated in float32).
void check_cache(const char* name, const char* of, const at::Tensor& cache, const at::Tensor& x,
                 RopeLayout layout, bool v) {
  TORCH_CHECK_TYPE(cache.scalar_type() == x.scalar_type() || kv_cache_format(cache) != KvCacheFormat::kSame,
                   "posenc: rope_append_kv: expected ", name, " to have ", of, "'s dtype ",
                   x.scalar_type(), " or a float8 dtype (torch.float8_e4m3fn, torch.float8_e5m2), got ",
                   cache.scalar_type(), " (the cache holds the new rows as they are, or quantised to "
                   "float8; convert it or ", of, ")");
  TORCH_CHECK_TYPE(kv_cache_format(cache) == KvCacheFormat::kSame || x.scalar_type() != at::kDouble,
                   "posenc: rope_append_kv: a float8 ", name, " takes ", of, " of dtype float32, "
                   "bfloat16 or float16 (its values are rotated in float32, then quantised), got ",
                   of, " of dtype ", x.scalar_type());
  check_same_device(name, cache, x);
  const bool ok = cache.dim() == 4 && [&] {
    const at::Tensor cv = kv_cache_view(cache, layout);
    return (layout == RopeLayout::kTHD || cv.sym_size(0) == x.sym_size(0)) &&
           cv.sym_size(2) == x.sym_size(2) && cv.sym_size(3) == x.sym_size(3);
  }();
  TORCH_CHECK(ok, "posenc: rope_append_kv: expected ", name, " of shape ", cache_shape(layout, v),
              " for layout '", rope_layout_name(layout), "' with ", of, " as (",
              layout == RopeLayout::kTHD ? "1, tokens" : "batch, seq", ", kv_heads, head_dim) = ",
              x.sym_sizes(), ", got shape ", cache.sym_sizes());
}

// A cache's scale: only with an FP8 cache; one float32 element on the CPU or on q's device.
// Its value is checked where it is read (kv_scale_value; on a device, by the kernel).
void check_scale(const char* name, const char* cache_name, const std::optional<at::Tensor>& scale,
                 const at::Tensor& cache, const at::Tensor& q) {
  if (!scale.has_value()) return;
  TORCH_CHECK_VALUE(kv_cache_format(cache) != KvCacheFormat::kSame, "posenc: rope_append_kv: ", name,
                    " is only used with a float8 ", cache_name, " (it divides the values before "
                    "they are quantised), got ", cache_name, " of dtype ", cache.scalar_type());
  TORCH_CHECK_TYPE(scale->scalar_type() == at::kFloat, "posenc: rope_append_kv: expected ", name,
                   " to be a Python float or a float32 tensor, got a tensor of dtype ",
                   scale->scalar_type());
  TORCH_CHECK_VALUE(scale->dim() <= 1 && scale->sym_numel() == 1, "posenc: rope_append_kv: expected ",
                    name, " to hold one value (shape () or (1,)), got shape ", scale->sym_sizes());
  TORCH_CHECK_VALUE(scale->is_cpu() || scale->device() == q.device(), "posenc: rope_append_kv: "
                    "expected ", name, " on the CPU or on q's device ", q.device(), ", got ", name,
                    " on ", scale->device());
}

}  // namespace

KvCacheFormat kv_cache_format(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat8_e4m3fn: return KvCacheFormat::kFloat8E4M3;
    case at::kFloat8_e5m2: return KvCacheFormat::kFloat8E5M2;
    default: return KvCacheFormat::kSame;
  }
}

float kv_scale_value(const char* name, const std::optional<at::Tensor>& scale) {
  if (!scale.has_value()) return 1.0f;
  TORCH_INTERNAL_ASSERT(scale->is_cpu());
  const float v = *scale->const_data_ptr<float>();
  TORCH_CHECK_VALUE(std::isfinite(v) && v > 0.0f, "posenc: rope_append_kv: expected ", name,
                    " to be a finite positive number (the values are divided by it), got ", v);
  return v;
}

int64_t check_rope_append_kv(const RopeAppendKvCall& c) {
  const RopeCall& r = c.rope;
  const RopeLayout layout = r.layout;
  TORCH_CHECK_VALUE(layout != RopeLayout::kSBHD, "posenc: rope_append_kv: expected layout 'bshd', "
                    "'bhsd' (contiguous cache) or 'thd' (paged cache), got 'sbhd'");
  TORCH_CHECK_VALUE(!r.cu_seqlens.has_value(), "posenc: rope_append_kv: cu_seqlens is not used; "
                    "for packed tokens pass layout 'thd' with positions and slot_mapping");
  TORCH_CHECK_VALUE(!r.inverse, "posenc: rope_append_kv: expected inverse=False");
  if (c.paged()) {
    TORCH_CHECK(r.q.dim() == 3 && r.k->dim() == 3, "posenc: rope_append_kv: expected q and k to "
                "be 3-D tensors (tokens, heads, head_dim) for layout 'thd', got q of shape ",
                r.q.sym_sizes(), " and k of shape ", r.k->sym_sizes());
    TORCH_CHECK_VALUE(c.slot_mapping.has_value(), "posenc: rope_append_kv: layout 'thd' (paged "
                      "cache) needs slot_mapping, the cache slot (block * block_size + index, or "
                      "-1) of each token");
    TORCH_CHECK_VALUE(!r.offsets.has_value(), "posenc: rope_append_kv: expected offset to be an "
                      "int for layout 'thd' (the tokens' rows come from slot_mapping), got a tensor");
    // For "thd" an int offset only shifts the default positions: beside given positions it
    // would be dropped (a symbolic one cannot be told from 0: refused too).
    const auto int_offset = r.offset.maybe_as_int();
    TORCH_CHECK_VALUE(!r.positions.has_value() || (int_offset.has_value() && *int_offset == 0),
                      "posenc: rope_append_kv: expected offset=0 beside positions for layout 'thd' "
                      "(an offset only shifts the default positions 0 .. tokens-1; add it to the "
                      "positions), got offset=", r.offset);
  } else {
    TORCH_CHECK_VALUE(!c.slot_mapping.has_value(), "posenc: rope_append_kv: slot_mapping is only "
                      "used with layout 'thd' (paged cache), got layout '", rope_layout_name(layout),
                      "'");
  }
  const RopeCall rot_call = c.rotation();
  const int64_t rot = check_rope_structure(rot_call);
  check_rope_settings(rot_call);
  TORCH_CHECK_VALUE(c.q_weight.has_value() == c.k_weight.has_value(), "posenc: rope_append_kv: "
                    "expected q_weight and k_weight together (QK-norm) or neither, got ",
                    c.q_weight.has_value() ? "q_weight alone" : "k_weight alone");
  if (c.normed()) {
    check_qk_norm_rope(c.normed_rotation(), /*backward=*/false);
  } else {
    TORCH_CHECK_VALUE(c.weight_offset == 0.0 && c.norm == QkNorm::kHead, "posenc: rope_append_kv: "
                      "weight_offset and norm set QK-norm, which needs q_weight and k_weight; got "
                      "weight_offset=", c.weight_offset, ", norm='", qk_norm_name(c.norm),
                      "' without weights");
  }
  if (const auto v = r.offset.maybe_as_int()) check_rope_position_value("offset", *v);
  if (r.offsets.has_value() && r.positions.has_value()) {  // not checked as the rotation's
    TORCH_CHECK_TYPE(r.offsets->scalar_type() == at::kLong, "posenc: rope_append_kv: expected "
                     "offset to be an int or an int64 tensor, got dtype ", r.offsets->scalar_type());
    check_same_device("offset", *r.offsets, r.q);
    TORCH_CHECK(r.offsets->dim() == 1 && r.offsets->sym_size(0) == rot_call.q.sym_size(0),
                "posenc: rope_append_kv: expected offset of shape (batch,) = (",
                kv_token_view(r.q, layout).sym_size(0), ",), got shape ", r.offsets->sym_sizes());
  }

  const at::Tensor k = kv_token_view(*r.k, layout);  // k's shape was checked with q's
  TORCH_CHECK_TYPE(c.v.scalar_type() == r.k->scalar_type(), "posenc: rope_append_kv: expected v "
                   "to have k's dtype ", r.k->scalar_type(), ", got ", c.v.scalar_type());
  check_same_device("v", c.v, r.q);
  const bool v_dims = c.v.dim() == r.k->dim();
  const at::Tensor v = v_dims ? kv_token_view(c.v, layout) : k;
  TORCH_CHECK(v_dims && v.sym_size(0) == k.sym_size(0) && v.sym_size(1) == k.sym_size(1) &&
                  v.sym_size(2) == k.sym_size(2),
              "posenc: rope_append_kv: expected v of k's shape but for head_dim, got v of shape ",
              c.v.sym_sizes(), " and k of shape ", r.k->sym_sizes(), " for layout '",
              rope_layout_name(layout), "'");
  check_cache("k_cache", "k", c.k_cache, k, layout, false);
  check_cache("v_cache", "v", c.v_cache, v, layout, true);
  check_scale("k_scale", "k_cache", c.k_scale, c.k_cache, r.q);
  check_scale("v_scale", "v_cache", c.v_scale, c.v_cache, r.q);
  TORCH_CHECK(c.k_cache.sym_size(0) == c.v_cache.sym_size(0) &&
                  kv_cache_view(c.k_cache, layout).sym_size(1) ==
                      kv_cache_view(c.v_cache, layout).sym_size(1),
              "posenc: rope_append_kv: expected k_cache and v_cache to hold as many rows, got "
              "shapes ", c.k_cache.sym_sizes(), " and ", c.v_cache.sym_sizes());
  if (c.slot_mapping.has_value()) {
    const at::Tensor& s = *c.slot_mapping;
    TORCH_CHECK_TYPE(s.scalar_type() == at::kLong, "posenc: rope_append_kv: expected slot_mapping "
                     "to have dtype torch.int64, got ", s.scalar_type());
    check_same_device("slot_mapping", s, r.q);
    TORCH_CHECK(s.dim() == 1 && s.sym_size(0) == r.q.sym_size(0), "posenc: rope_append_kv: "
                "expected slot_mapping of shape (tokens,) = (", r.q.sym_size(0), ",), got shape ",
                s.sym_sizes());
  }
  return rot;
}

void check_rope_append_kv_overlap(const RopeAppendKvCall& c, bool in_place) {
  // Written: the caches, and in place q (and k with return_k). Read: q, k, v and the index
  // tensors. With v aliasing q or k in place, the kernel would copy rotated values into the
  // v cache; with a cache over an input, it would read rows it already wrote.
  const RopeCall& r = c.rope;
  const bool writes_k = in_place && c.return_k;
  const MemoryOperand q{"q", &r.q}, k{"k", &*r.k}, none;
  const auto optional = [](const std::optional<at::Tensor>& t) { return t ? &*t : nullptr; };
  check_written_memory(
      in_place ? "rope_append_kv_" : "rope_append_kv",
      {{"k_cache", &c.k_cache}, {"v_cache", &c.v_cache}, in_place ? q : none, writes_k ? k : none},
      {in_place ? none : q, writes_k ? none : k, {"v", &c.v}, {"positions", optional(r.positions)},
       {"offset", optional(r.offsets)}, {"slot_mapping", optional(c.slot_mapping)},
       {"k_scale", optional(c.k_scale)}, {"v_scale", optional(c.v_scale)},
       {"q_weight", optional(c.q_weight)}, {"k_weight", optional(c.k_weight)}},
      in_place ? "pass copies or use inplace=False"
               : "the caches must be memory of their own (pass copies of the inputs; caches that torch "
                 "did not allocate, shared or mapped from a file, as views of one storage)");
}

void check_rope_append_kv_rows(const KvCacheArgs& a) {
  const int64_t batch = a.rope.batch, seq = a.rope.seq;
  if (batch * seq == 0) return;
  if (a.slot_mapping != nullptr) {
    for (int64_t s = 0; s < seq; ++s) {
      const int64_t slot = a.slot_mapping[s];
      TORCH_CHECK_INDEX(slot >= -1 && slot < a.num_slots, "posenc: rope_append_kv: slot_mapping[",
                        s, "] = ", slot, " is out of range for a cache of ", a.num_slots,
                        " slots (num_blocks * block_size; -1: not written); nothing was written");
    }
    // Two tokens for one slot: the tokens run on different threads, so the slot would hold
    // either one (a data race). Refused, before anything is written.
    std::vector<std::pair<int64_t, int64_t>> slots;  // (slot, token)
    slots.reserve(static_cast<size_t>(seq));
    for (int64_t s = 0; s < seq; ++s) {
      if (a.slot_mapping[s] >= 0) slots.emplace_back(a.slot_mapping[s], s);
    }
    std::sort(slots.begin(), slots.end());
    for (size_t i = 1; i < slots.size(); ++i) {
      TORCH_CHECK_VALUE(slots[i].first != slots[i - 1].first, "posenc: rope_append_kv: slot_mapping[",
                        slots[i - 1].second, "] and slot_mapping[", slots[i].second,
                        "] are both ", slots[i].first,
                        "; expected each written slot once (-1: not written); nothing was written");
    }
    return;
  }
  for (int64_t b = 0; b < batch; ++b) {
    if (a.offsets != nullptr) check_rope_position_value("offset", a.offsets[b]);
    const int64_t first = a.offset + (a.offsets != nullptr ? a.offsets[b] : 0);
    TORCH_CHECK_INDEX(first >= 0 && first <= a.max_len - seq, "posenc: rope_append_kv: batch row ",
                      b, " writes cache rows ", first, " .. ", first + seq - 1,
                      " (offset + its cache length so far .. + seq - 1), out of range for max_len ",
                      a.max_len, "; nothing was written");
  }
}

// ---- The launch preparation and the boxed body every backend's kernel shares

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
  a.k_format = kv_cache_format(c.k_cache);
  a.v_format = kv_cache_format(c.v_cache);
  // A scale on the CPU is read here (and checked: ValueError); one on the kernel's device is
  // read by the kernel (no host sync; a bad value stops it with a device-side assert).
  const auto scale = [](const char* name, const std::optional<at::Tensor>& s, float* value,
                        const float* *ptr) {
    if (s.has_value() && !s->is_cpu()) {
      *ptr = s->const_data_ptr<float>();
    } else {
      *value = kv_scale_value(name, s);
    }
  };
  scale("k_scale", c.k_scale, &a.k_scale, &a.k_scale_ptr);
  scale("v_scale", c.v_scale, &a.v_scale, &a.v_scale_ptr);
  if (c.normed()) {
    launch.q_weight = qk_norm_effective_weight(*c.q_weight, c.weight_offset, c.rope.q);
    launch.k_weight = qk_norm_effective_weight(*c.k_weight, c.weight_offset, c.rope.q);
    a.q_weight = launch.q_weight.const_data_ptr();
    a.k_weight = launch.k_weight.const_data_ptr();
    a.eps = c.eps;
    a.norm = c.norm;
  }
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

void run_rope_append_kv_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool in_place,
                              KvOutputAllocator allocate, KvKernelRunner run, bool check_rows) {
  const RopeAppendKvCall c = RopeAppendKvCall::pop(*stack);
  check_keep_k_overload(op, c);
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

// ---- Schemas and the Autograd kernel

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  const std::string tail = kRopeSchemaArguments;
  const std::string middle =
      "Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? slot_mapping=None, "
      "bool return_k=False, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? q_weight=None, "
      "Tensor? k_weight=None, " + std::string(kQkNormSchemaSettings) + ", ";
  m.def(("rope_append_kv(Tensor q, Tensor k, " + middle + tail + ") -> (Tensor, Tensor)").c_str());
  m.def(("rope_append_kv_(Tensor(c!) q, Tensor(d!) k, " + middle + tail + ") -> ()").c_str());
  // The in-place call without return_k: k is read only, so its schema says so (a version
  // counter, functionalization under torch.compile and the negative bit then treat k as read).
  m.def(("rope_append_kv_." + std::string(kKeepK) + "(Tensor(c!) q, Tensor k, " + middle + tail + ") -> ()").c_str());
}

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  m.impl("rope_append_kv", torch::CppFunction::makeFromBoxedFunction<&inference_only_autograd>());
  m.impl("rope_append_kv_", torch::CppFunction::makeFromBoxedFunction<&inference_only_autograd>());
  m.impl("rope_append_kv_.keep_k", torch::CppFunction::makeFromBoxedFunction<&inference_only_autograd>());
}

POSENC_REGISTER_WRITTEN_LAYERS("rope_append_kv")
POSENC_REGISTER_WRITTEN_LAYERS("rope_append_kv_")
POSENC_REGISTER_WRITTEN_LAYERS("rope_append_kv_.keep_k")

// ---- Meta kernels
// The real kernels' checks (the memory proof included) and q's (and k's) shape, so torch.compile and torch.export trace
// the op (the caches are mutated arguments of the schema: functionalization handles them).

namespace {

RopeAppendKvCall checked_append_kv_meta_call(const char* op, torch::jit::Stack* stack, bool in_place) {
  RopeAppendKvCall c = RopeAppendKvCall::pop(*stack);
  check_rope_append_kv(c);
  check_not_mixed_with_meta(op, {{"q", &c.rope.q}, {"k", optional_ptr(c.rope.k)}, {"v", &c.v},
                                 {"k_cache", &c.k_cache}, {"v_cache", &c.v_cache},
                                 {"slot_mapping", optional_ptr(c.slot_mapping)},
                                 {"positions", optional_ptr(c.rope.positions)},
                                 {"offset", optional_ptr(c.rope.offsets)},
                                 {"q_weight", optional_ptr(c.q_weight)},
                                 {"k_weight", optional_ptr(c.k_weight)}});
  check_rope_append_kv_overlap(c, in_place);
  return c;
}

void rope_append_kv_meta(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const RopeAppendKvCall c = checked_append_kv_meta_call("rope_append_kv", stack, /*in_place=*/false);
  stack->emplace_back(at::empty_like(c.rope.q));
  stack->emplace_back(c.return_k ? at::empty_like(*c.rope.k) : at::empty({0}, c.rope.q.options()));
}

void rope_append_kv_inplace_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  check_keep_k_overload(op, checked_append_kv_meta_call("rope_append_kv_", stack, /*in_place=*/true));
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("rope_append_kv", torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_meta>());
  m.impl("rope_append_kv_", torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_inplace_meta>());
  m.impl("rope_append_kv_.keep_k", torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_inplace_meta>());
}

// ---- The ATen composite
// rope_append_kv and rope_append_kv_ composed from ATen ops, for backends without a kernel of
// their own (the ATen fallback, ops/common/aten_fallback.h): the same checks, the rotation by
// the rope op of q's device (its kernel or its own fallback), then the writes of k and v into
// the cache rows. One error contract with the kernels, and no host sync:
// - CPU index tensors are checked on the host before anything is written (IndexError, as the
//   kernel's check_rope_append_kv_rows: reading them costs nothing);
// - on a device the rows are not read back (nonzero or .item() would sync every call): a row
//   outside the cache fails on the device (at::_assert_async where the device has it, as the
//   CUDA kernel's assert, and an index outside the cache that makes index_put_ fail), and
//   slots -1 write nothing without being left out of the index (write_paged_rows, aten_fallback.h).
// Two tokens for one slot: refused on the CPU; on a device the caller's error, the slot then
// holds an unspecified mix of them (index_put_ stores element by element), as on CUDA.

namespace {

void run_composite(torch::jit::Stack* stack, bool in_place, const c10::OperatorHandle* op = nullptr) {
  const RopeAppendKvCall c = RopeAppendKvCall::pop(*stack);
  if (op != nullptr) check_keep_k_overload(*op, c);
  check_rope_append_kv(c);
  check_rope_append_kv_overlap(c, in_place);
  const at::Tensor& q = c.rope.q;
  warn_aten_fallback("rope_append_kv", q.device());
  const RopeCall r = c.rotation();
  // With QK-norm the rotation is qk_norm_rope's (q and k normalised, then rotated).
  const auto [q_rot, k_rot] = c.normed() ? call_qk_norm_rope(c.normed_rotation()) : call_rope(r);
  const RopeLayout layout = c.rope.layout;
  at::Tensor k_tokens = rope_canonical_view(k_rot, r.layout);  // (batch, seq, heads, d)
  at::Tensor v_tokens = kv_token_view(c.v, layout);
  at::Tensor kc = kv_cache_view(c.k_cache, layout);
  at::Tensor vc = kv_cache_view(c.v_cache, layout);
  // FP8 caches: the kernels' values (kv_quantize): k rotated in float32 (a float32 copy's
  // rotation, not k's rounded one), divided by the scale, saturated, rounded to nearest even;
  // written as their bits (uint8 views, which every indexing op below takes).
  const auto quantised = [&](const at::Tensor& x32, const at::Tensor& cache,
                             const std::optional<at::Tensor>& scale, const char* name) {
    at::Tensor y = x32;
    if (scale.has_value()) {
      const at::Tensor s = scale->reshape({});
      if (s.is_cpu()) {
        kv_scale_value(name, s);
      } else {
        assert_all_on_device(s.gt(0).logical_and(s.isfinite()),
                             "posenc: rope_append_kv: expected k_scale and v_scale to be finite "
                             "positive numbers");
      }
      y = y.div(s);
    }
    const double m = kv_format_max(kv_cache_format(cache));
    return y.clamp(-m, m).to(cache.scalar_type()).view(at::kByte);
  };
  if (kv_cache_format(c.k_cache) != KvCacheFormat::kSame) {
    // k's rotation on a float32 copy (with QK-norm: qk_norm_rope's, k as both operands).
    at::Tensor k32;
    if (c.normed()) {
      QkNormRopeCall n = c.normed_rotation();
      n.rope.q = r.k->to(at::kFloat);
      n.rope.k = n.rope.q;
      n.q_weight = n.k_weight = c.k_weight->to(at::kFloat);
      k32 = std::get<1>(call_qk_norm_rope(n));
    } else {
      RopeCall r32 = r;
      r32.q = r.k->to(at::kFloat);
      r32.k = std::nullopt;
      k32 = std::get<0>(call_rope(r32));
    }
    k_tokens = quantised(rope_canonical_view(k32, r.layout), kc, c.k_scale, "k_scale");
    kc = kc.view(at::kByte);
  }
  if (kv_cache_format(c.v_cache) != KvCacheFormat::kSame) {
    v_tokens = quantised(v_tokens.to(at::kFloat), vc, c.v_scale, "v_scale");
    vc = vc.view(at::kByte);
  }
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
      write_paged_rows(kc, k_tokens.select(0, 0), slots, unwritten, block, index);
      write_paged_rows(vc, v_tokens.select(0, 0), slots, unwritten, block, index);
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
                               "or its offset is outside " POSENC_ROPE_POSITION_RANGE);
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

void rope_append_kv_inplace_composite(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_composite(stack, /*in_place=*/true, &op);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("rope_append_kv", torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_composite>());
  for (const char* name : {"rope_append_kv_", "rope_append_kv_.keep_k"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&rope_append_kv_inplace_composite>());
  }
}

// ---- CPU backend
// The shared boxed body (run_rope_append_kv_boxed) with every row or slot checked before the
// kernel writes anything (IndexError, the caches unchanged), and the vectorised kernel of
// cpu/kernel.cpp.

namespace {

void run_rope_append_kv_cpu(const KvLaunch& launch, const at::Tensor& q) {
  cpu::rope_append_kv_stub::get()(launch.args, q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope_append_kv",
         torch::CppFunction::makeFromBoxedFunction<
             &rope_append_kv_kernel_boxed<&empty_output_like, &run_rope_append_kv_cpu, true>>());
  for (const char* name : {"rope_append_kv_", "rope_append_kv_.keep_k"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &rope_append_kv_inplace_kernel_boxed<&empty_output_like, &run_rope_append_kv_cpu, true>>());
  }
}

}  // namespace ops
}  // namespace posenc

// ---- CUDA backend: the same boxed body (structural checks; index values are checked on the
// device) with outputs from empty_like, and the launch of cuda/rope_append_kv/rope_append_kv.cu's
// kernel on q's device and current stream.
#if defined(POSENC_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/rope_append_kv/launch.h"

namespace posenc {
namespace ops {
namespace {

void run_rope_append_kv_cuda(const KvLaunch& launch, const at::Tensor& q) {
  const c10::cuda::CUDAGuard guard(q.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "posenc_rope_append_kv_cuda", [&] {
    C10_CUDA_CHECK(launch_rope_append_kv<scalar_t>(launch.args, at::cuda::getCurrentCUDAStream()));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("rope_append_kv",
         torch::CppFunction::makeFromBoxedFunction<
             &rope_append_kv_kernel_boxed<&empty_like_input, &run_rope_append_kv_cuda, false>>());
  for (const char* name : {"rope_append_kv_", "rope_append_kv_.keep_k"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &rope_append_kv_inplace_kernel_boxed<&empty_like_input, &run_rope_append_kv_cuda, false>>());
  }
}

}  // namespace ops
}  // namespace posenc
#endif  // POSENC_WITH_CUDA
