// The in-place proof: rope_ may rotate q and k in their own storage only when no element
// is shared (two threads would otherwise read what another already rotated).
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <limits>

#include "ops/rope/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

// True when q and k (canonical (B, S, H, D) views of one storage) provably share no element,
// for the common case that at::get_overlap_status cannot decide: slices of one fused qkv
// buffer, i.e. the same (batch, seq) strides, every (b, s) row starting at a multiple of the
// seq stride, and the two rows' extents disjoint modulo that stride.
bool rows_provably_disjoint(const at::Tensor& q, const at::Tensor& k) {
  if (q.stride(0) != k.stride(0) || q.stride(1) != k.stride(1)) return false;
  const int64_t row = q.stride(1);
  if (row <= 0 || (q.size(0) > 1 && q.stride(0) % row != 0)) return false;
  auto extent = [](const at::Tensor& t) {
    int64_t e = 1;
    for (int d = 2; d < 4; ++d) {
      if (t.stride(d) < 0) return std::numeric_limits<int64_t>::max();
      e += (t.size(d) - 1) * t.stride(d);
    }
    return e;
  };
  const int64_t eq = extent(q), ek = extent(k);
  if (eq > row || ek > row) return false;
  const int64_t oq = q.storage_offset() % row, ok = k.storage_offset() % row;
  // Circular intervals [oq, oq + eq) and [ok, ok + ek) on a circle of length `row`.
  const int64_t dq = ((ok - oq) % row + row) % row;  // where k starts, seen from q
  return dq >= eq && dq + ek <= row;
}

}  // namespace

void check_rope_inplace(const RopeCall& c) {
  const at::Tensor& q = c.q;
  TORCH_CHECK(at::has_internal_overlap(q) != at::MemOverlap::Yes,
              "posenc: inplace=True needs q without internal overlap (an expanded tensor ",
              "cannot be rotated in place); pass a contiguous copy or use inplace=False");
  if (!c.k.has_value()) return;
  const at::Tensor& k = *c.k;
  TORCH_CHECK(at::has_internal_overlap(k) != at::MemOverlap::Yes,
              "posenc: inplace=True needs k without internal overlap (an expanded tensor ",
              "cannot be rotated in place); pass a contiguous copy or use inplace=False");
  // at::get_overlap_status answers TooHard for any tensor that is not dense before it looks
  // at storages, so two strided views of separate allocations would be refused. Different
  // storages are separate when their bytes are (two storages can wrap one buffer:
  // from_blob, DLPack, numpy); the row-disjointness proof below needs one storage.
  if (q.has_storage() && k.has_storage() && !q.storage().is_alias_of(k.storage())) {
    const auto* q0 = static_cast<const char*>(q.storage().data());
    const auto* k0 = static_cast<const char*>(k.storage().data());
    const bool disjoint = q0 + q.storage().nbytes() <= k0 || k0 + k.storage().nbytes() <= q0;
    TORCH_CHECK(disjoint, "posenc: inplace=True needs q and k in separate memory, got two ",
                "storages over overlapping memory; use inplace=False");
    return;
  }
  const auto overlap = at::get_overlap_status(q, k);
  bool separate = overlap == at::MemOverlapStatus::No;
  if (overlap == at::MemOverlapStatus::TooHard) {
    separate = rows_provably_disjoint(rope_canonical_view(q, c.layout),
                                      rope_canonical_view(k, c.layout));
  }
  TORCH_CHECK(separate, "posenc: inplace=True needs q and k in separate memory, got ",
              overlap == at::MemOverlapStatus::TooHard ? "views whose separation cannot be proven"
                                                       : "overlapping tensors",
              "; use inplace=False");
}

}  // namespace ops
}  // namespace posenc
