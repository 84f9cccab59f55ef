// rope_append_kv: rotate q and k (every RoPE feature, through RopeCall) and write k and v
// into a KV cache in the same pass, for decoding. This header is the family's host side:
// the parsed call, its checks, the launch preparation shared by the CPU and CUDA kernels
// (all in rope_append_kv.cpp); the kernels' plain data, KvCacheArgs, is in cpu/kernel.h.
//
// Schemas (rope_append_kv.cpp); the tail after slot_mapping/return_k is RoPE's
// (kRopeSchemaArguments), read by RopeCall::pop:
//   rope_append_kv(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache,
//                  Tensor? slot_mapping=None, bool return_k=False, Tensor? k_scale=None,
//                  Tensor? v_scale=None, Tensor? q_weight=None, Tensor? k_weight=None,
//                  float eps=1e-06, float weight_offset=0.0, str norm="head", <RoPE tail>)
//       -> (Tensor q_rotated, Tensor k_rotated or an empty tensor)
//   rope_append_kv_(Tensor(c!) q, Tensor(d!) k, ...same...) -> ()   q (and k with return_k)
//                                                                    rotated in place
// Layouts: "bshd" (cache (batch, max_len, kv_heads, head_dim)), "bhsd" (Hugging Face's
// static cache (batch, kv_heads, max_len, head_dim); q, k, v (batch, heads, seq, head_dim)),
// "thd" (q, k, v (tokens, heads, head_dim); paged cache (num_blocks, block_size, kv_heads,
// head_dim) addressed by slot_mapping, -1: rotate, write nothing). The tail's offset /
// offsets are the cache lengths so far: token s of batch row b goes to row offset +
// offsets[b] + s, and is rotated there unless positions are given (then at positions).
// FP8 caches: a cache of dtype float8_e4m3fn or float8_e5m2 (k of float32, bfloat16 or
// float16) holds each value quantised with its scale (k_scale / v_scale: 0-d or 1-element
// float32 tensors, on the CPU or on q's device; default 1): the rotation in float32, divided by
// the scale, saturated, rounded to nearest even (kv_quantize, cpu/kernel.h).
// QK-norm (q_weight and k_weight given): q and k normalised as qk_norm_rope normalises them
// (its norm settings), then rotated and written: the cache holds qk_norm_rope's k (an FP8
// cache: qk_norm_rope's k of a float32 copy of k, quantised). Inference only, as the rest.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

#include "ops/common/rope_call.h"
#include "ops/common/rope_launch.h"
#include "ops/qk_norm_rope/qk_norm_rope.h"
#include "ops/rope_append_kv/cpu/kernel.h"

namespace posenc {
namespace ops {

struct RopeAppendKvCall {
  RopeCall rope;  // q, k and the RoPE tail as the caller gave them (offsets: cache offsets)
  at::Tensor v, k_cache, v_cache;
  std::optional<at::Tensor> slot_mapping;
  bool return_k = false;
  std::optional<at::Tensor> k_scale, v_scale;  // FP8 caches only
  std::optional<at::Tensor> q_weight, k_weight;  // QK-norm (both or neither)
  double eps = 1e-6;
  double weight_offset = 0.0;
  QkNorm norm = QkNorm::kHead;

  // Pops a boxed call of rope_append_kv / rope_append_kv_ (the whole schema).
  static RopeAppendKvCall pop(torch::jit::Stack& stack);
  // The rotation alone as a RoPE call: "thd" as "bshd" with batch 1; without positions the
  // tokens turn at their rows (offset + offsets[b] + s), with positions at those alone.
  RopeCall rotation() const;
  bool paged() const { return rope.layout == RopeLayout::kTHD; }
  bool normed() const { return q_weight.has_value(); }
  // With QK-norm: the rotation as a qk_norm_rope call (its weights and settings).
  QkNormRopeCall normed_rotation() const;
};

// What a cache holds: kSame for a cache of the tokens' dtype, the FP8 format otherwise.
KvCacheFormat kv_cache_format(const at::Tensor& cache);
// The value of a scale held on the CPU (1 without one): ValueError unless finite and > 0.
float kv_scale_value(const char* name, const std::optional<at::Tensor>& scale);

// (batch, seq, heads, head_dim) view of q, k or v ("thd": batch 1), and the cache as
// (batch or block, row or index, kv_heads, head_dim): no copies.
at::Tensor kv_token_view(const at::Tensor& x, RopeLayout layout);
at::Tensor kv_cache_view(const at::Tensor& cache, RopeLayout layout);

// Every check that needs no tensor value (shapes, dtypes, devices, settings); works on Meta
// tensors. Returns the resolved rotary_dim.
int64_t check_rope_append_kv(const RopeAppendKvCall& call);
// The values: every cache row or slot the call writes lies in the cache (IndexError naming
// the batch row or token, before anything is written), for CPU index tensors; and the
// memory: nothing the call writes (the caches; q, and k with return_k, in place) shares a
// byte with itself or with any other tensor argument (check_written_memory, rope_checks.h).
void check_rope_append_kv_rows(const KvCacheArgs& args);
void check_rope_append_kv_overlap(const RopeAppendKvCall& call, bool in_place);

// The boxed op calls of the C++ API: rope_append_kv returns (q, k or an empty tensor),
// rope_append_kv_ works in place (its overload kKeepK without return_k).
std::tuple<at::Tensor, at::Tensor> call_rope_append_kv(const RopeAppendKvCall& call);
void call_rope_append_kv_inplace(const RopeAppendKvCall& call);

// rope_append_kv_'s overload for calls without return_k: its schema reads k (Tensor k) where
// rope_append_kv_'s writes it (Tensor(d!) k), since only return_k writes the rotated k into k;
// a schema cannot make a write depend on a bool, and an argument marked written that is not
// moved its version counter, refused graphs that had saved k and, under torch.compile, was
// copied back. Each in-place kernel refuses return_k=True in it (check_keep_k_overload).
constexpr const char* kKeepK = "keep_k";
void check_keep_k_overload(const c10::OperatorHandle& op, const RopeAppendKvCall& call);

struct KvLaunch {
  KvCacheArgs args;
  RopeLaunch rope;  // keeps the rotation's index tensors alive
  at::Tensor offsets, slot_mapping;
  at::Tensor q_weight, k_weight;  // QK-norm: the effective weights
};

using KvOutputAllocator = at::Tensor (*)(const at::Tensor& like);
using KvKernelRunner = void (*)(const KvLaunch& launch, const at::Tensor& q);

// The body of the boxed kernels of every backend: pop, check, allocate, prepare, launch,
// push (q and k or an empty tensor; nothing in place).
void run_rope_append_kv_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool in_place,
                              KvOutputAllocator allocate, KvKernelRunner run, bool check_rows);

template <KvOutputAllocator Allocate, KvKernelRunner Run, bool kCheckRows>
void rope_append_kv_kernel_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_rope_append_kv_boxed(op, stack, /*in_place=*/false, Allocate, Run, kCheckRows);
}
template <KvOutputAllocator Allocate, KvKernelRunner Run, bool kCheckRows>
void rope_append_kv_inplace_kernel_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_rope_append_kv_boxed(op, stack, /*in_place=*/true, Allocate, Run, kCheckRows);
}

}  // namespace ops
}  // namespace posenc
