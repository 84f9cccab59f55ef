// rope_append_kv's checks: the rotation's are RoPE's own (check_rope_structure and
// check_rope_settings on RopeAppendKvCall::rotation); these add v, the caches,
// slot_mapping, and the values of the rows written. Each message names the argument.
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "ops/common/rope_checks.h"
#include "ops/rope_append_kv/rope_append_kv_call.h"

namespace posenc {
namespace ops {
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

// One cache against the new tokens (x: k or v as (batch, seq, heads, head_dim)).
void check_cache(const char* name, const char* of, const at::Tensor& cache, const at::Tensor& x,
                 RopeLayout layout, bool v) {
  TORCH_CHECK_TYPE(cache.scalar_type() == x.scalar_type(), "posenc: rope_append_kv: expected ",
                   name, " to have ", of, "'s dtype ", x.scalar_type(), ", got ", cache.scalar_type(),
                   " (the cache holds the new rows as they are; convert it or ", of, ")");
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

}  // namespace

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
  } else {
    TORCH_CHECK_VALUE(!c.slot_mapping.has_value(), "posenc: rope_append_kv: slot_mapping is only "
                      "used with layout 'thd' (paged cache), got layout '", rope_layout_name(layout),
                      "'");
  }
  const RopeCall rot_call = c.rotation();
  const int64_t rot = check_rope_structure(rot_call);
  check_rope_settings(rot_call);
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
       {"offset", optional(r.offsets)}, {"slot_mapping", optional(c.slot_mapping)}},
      in_place ? "pass copies or use inplace=False"
               : "the caches must be memory of their own (pass copies of the inputs)");
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

}  // namespace ops
}  // namespace posenc
