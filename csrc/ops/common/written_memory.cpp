// The proof that an op may write where it writes: every tensor a kernel writes (rope_'s q
// and k, qk_norm_rope_'s q and k, rope_append_kv's caches and, in place, its q and k) must
// share no byte with anything else the call reads or writes, nor with itself. A kernel that
// writes over what another thread still reads computes a wrong answer (rope_append_kv_ with
// v aliasing k copied the rotated k into the v cache), so "cannot tell" is a refusal.
#include <ATen/MemoryOverlap.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops/common/rope_checks.h"

namespace posenc {
namespace ops {
namespace {

int64_t item_bytes(const at::Tensor& t) { return static_cast<int64_t>(t.element_size()); }

// The address of t's first element, as an integer: its storage's plus its offset (a Meta
// tensor's storage starts at 0, so two views of one Meta storage compare as well).
std::uintptr_t address(const at::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.storage().data()) +
         static_cast<std::uintptr_t>(t.storage_offset() * item_bytes(t));
}

// Whether t's storage has memory whose address can be compared with another storage's (not
// a Meta tensor's or a wrapper subclass's, whose storages are their own identity).
bool has_address(const at::Tensor& t) { return t.storage().data() != nullptr; }

// The bytes [lo, hi) between t's lowest and highest element (t not empty).
std::pair<std::uintptr_t, std::uintptr_t> byte_span(const at::Tensor& t) {
  int64_t lo = 0, hi = item_bytes(t);
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d) * item_bytes(t);
    (reach < 0 ? lo : hi) += reach;
  }
  const std::uintptr_t base = address(t);
  return {base + static_cast<std::uintptr_t>(lo), base + static_cast<std::uintptr_t>(hi)};
}

// The bytes of t modulo m, when they fit a circular interval [start, start + *extent) of the
// circle of length m: each dimension whose byte stride is a multiple of m moves an element by
// whole turns; the others add up to at most *extent - element size <= m - element size.
bool extent_modulo(const at::Tensor& t, int64_t m, int64_t* extent) {
  int64_t e = item_bytes(t);
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) <= 1) continue;
    const int64_t stride = t.stride(d) * item_bytes(t);
    if (stride % m == 0) continue;
    if (stride < 0 || t.size(d) - 1 > (m - e) / stride) return false;  // past m (no overflow)
    e += (t.size(d) - 1) * stride;
  }
  *extent = e;
  return e <= m;
}

// True when a and b provably share no byte by their addresses modulo m, for m one of their
// byte strides: both views' bytes fit circular intervals modulo m (extent_modulo), and those
// intervals are disjoint. This decides what the spans and at::get_overlap_status cannot:
// slices of one buffer whose rows or heads interleave (q, k, v of a fused qkv projection; k
// and v caches in one (blocks, block_size, heads, 2, head_dim) buffer). Addresses, not
// storage offsets: it holds over two storages of one buffer too.
bool residues_provably_disjoint(const at::Tensor& a, const at::Tensor& b) {
  std::vector<int64_t> moduli;
  for (const at::Tensor* t : {&a, &b}) {
    for (int64_t d = 0; d < t->dim(); ++d) {
      if (t->size(d) > 1 && t->stride(d) > 0) moduli.push_back(t->stride(d) * item_bytes(*t));
    }
  }
  std::sort(moduli.begin(), moduli.end());
  moduli.erase(std::unique(moduli.begin(), moduli.end()), moduli.end());
  for (const int64_t m : moduli) {
    int64_t ea = 0, eb = 0;
    if (!extent_modulo(a, m, &ea) || !extent_modulo(b, m, &eb)) continue;
    const auto um = static_cast<std::uintptr_t>(m);
    const auto oa = static_cast<int64_t>(address(a) % um);
    const auto ob = static_cast<int64_t>(address(b) % um);
    const int64_t d = ((ob - oa) % m + m) % m;  // where b starts, seen from a
    if (d >= ea && d + eb <= m) return true;
  }
  return false;
}

// Whether t's memory lies at its own addresses alone. Host memory that torch's CPU
// allocator made (its data carries that allocator's deleter: heap memory) does; host memory
// from elsewhere (a file or shared memory mapped by torch.from_file or share_memory_, a
// numpy, DLPack or from_blob buffer) may be one memory at two addresses: two mappings of one
// file are two storages whose addresses differ, and a kernel that writes one reads the
// other's bytes changing under it (pinned host memory too: another allocator's, refused in
// pairs). Device memory is compared by address: a process normally maps a CUDA allocation
// once (the caching allocator's blocks; IPC handles do not open in the process that made
// them); one mapped twice through CUDA's virtual-memory API is not seen (not run on a GPU).
bool private_memory(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  if (s.device_type() != c10::DeviceType::CPU) return true;
  const c10::Allocator* allocator = c10::GetCPUAllocator();
  const c10::DeleterFnPtr deleter = allocator == nullptr ? nullptr : allocator->raw_deleter();
  return deleter != nullptr && s.data_ptr().get_deleter() == deleter;
}

// Why a and b were not proven apart, for the message.
const char* overlap_detail(const at::Tensor& a, const at::Tensor& b) {
  if (!a.has_storage() || !b.has_storage()) return "tensors without storage, which cannot be checked";
  if (!a.storage().is_alias_of(b.storage())) {
    const auto [a_lo, a_hi] = byte_span(a);
    const auto [b_lo, b_hi] = byte_span(b);
    return a_lo < b_hi && b_lo < a_hi
               ? "two storages over overlapping memory"
               : "two host storages neither of which torch's CPU allocator made (memory mapped from a "
                 "file or shared, a numpy, DLPack or from_blob buffer: one memory may lie at two "
                 "addresses, which no address comparison can rule out)";
  }
  const auto s = at::get_overlap_status(a, b);
  return s == at::MemOverlapStatus::TooHard ? "views whose separation cannot be proven"
                                            : "overlapping tensors";
}

const at::Tensor* tensor_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? &*t : nullptr;
}

}  // namespace

bool provably_disjoint(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return true;
  if (!a.has_storage() || !b.has_storage()) return false;
  const bool one_storage = a.storage().is_alias_of(b.storage());
  // Two storages share memory only when they wrap one buffer (from_blob, DLPack, numpy) or
  // map one file or shared memory twice; a Meta or wrapper storage has no address (its own
  // identity). Their addresses tell where one of them is private memory (private_memory:
  // device memory, or host memory of torch's CPU allocator): then the other can share its
  // bytes only at the same addresses.
  if (!one_storage && (!has_address(a) || !has_address(b))) return true;
  if (!one_storage && !private_memory(a) && !private_memory(b)) return false;
  const auto [a_lo, a_hi] = byte_span(a);
  const auto [b_lo, b_hi] = byte_span(b);
  if (a_hi <= b_lo || b_hi <= a_lo) return true;
  // at::get_overlap_status answers for dense views of one storage (TooHard for any view
  // that is not dense, before it looks at storages); for dense views the spans above
  // already decided, so only its No can add anything.
  if (one_storage && at::get_overlap_status(a, b) == at::MemOverlapStatus::No) return true;
  return residues_provably_disjoint(a, b);
}

bool provably_no_internal_overlap(const at::Tensor& t) {
  const at::MemOverlap m = at::has_internal_overlap(t);
  if (m != at::MemOverlap::TooHard) return m == at::MemOverlap::No;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return true;
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest offset the smaller strides reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

void check_written_memory(const char* op, std::initializer_list<MemoryOperand> written,
                          std::initializer_list<MemoryOperand> read, const char* remedy) {
  // A written view at a symbolic storage offset (torch.compile's and torch.export's dynamic
  // shapes: layer i of stacked caches, k_caches[i]; qkv.unbind(0)[1]; kpool[n:].view(...)):
  // Inductor's re-inplacing of a custom op regenerates that view at offset 0
  // (pytorch/pytorch#198068, torch 2.11), so the op would write at the start of the base
  // buffer, silently. Neither the backend nor where the symbol comes from (an input view's own
  // offset, which Inductor keeps, or one computed in the graph: torch.export fixes its inputs'
  // offsets, and a lone symbol can be a size) can be told here: refused when traced.
  for (const MemoryOperand& w : written) {
    if (w.tensor == nullptr || !w.tensor->defined()) continue;
    const c10::SymInt offset = w.tensor->sym_storage_offset();
    TORCH_CHECK(offset.maybe_as_int().has_value(), "posenc: ", op, ": ", w.name,
                " is a view at a symbolic storage offset (", offset,
                ": torch.compile or torch.export with dynamic shapes), which Inductor's in-place "
                "custom-op calls can drop (pytorch/pytorch#198068: the op would write at offset 0 of "
                "the base buffer); pass ", w.name, " as a tensor of its own (a layer's own cache, not "
                "a slice of a stacked buffer at a dynamic offset), mark those sizes static, or "
                "(rope_, qk_norm_rope_) rotate out of place");
  }
  // A tensor with symbolic sizes, strides or offsets has no numbers to prove anything with:
  // its checks are left to the real kernel, which runs them when the call runs; the pairs of
  // concrete Meta and fake tensors are checked as real ones (the views of one storage compare
  // by offset), so tracing refuses what eager refuses wherever the sizes are known.
  const auto symbolic = [](const at::Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); };
  for (auto w = written.begin(); w != written.end(); ++w) {
    if (w->tensor == nullptr || symbolic(*w->tensor)) continue;
    TORCH_CHECK(provably_no_internal_overlap(*w->tensor), "posenc: ", op, ": expected ", w->name,
                " without internal overlap (it is written, and an expanded tensor or a view "
                "whose elements cannot be proven distinct cannot be), got ",
                w->tensor->sizes(), " with strides ", w->tensor->strides(), "; ", remedy);
    auto check = [&](const MemoryOperand& x, const char* role) {
      if (x.tensor == nullptr || (x.tensor->defined() && symbolic(*x.tensor))) return;
      TORCH_CHECK(provably_disjoint(*w->tensor, *x.tensor), "posenc: ", op, ": expected ",
                  w->name, " and ", x.name, " in separate memory (", w->name, " is written, ",
                  x.name, " ", role, "), got ", overlap_detail(*w->tensor, *x.tensor), "; ",
                  remedy);
    };
    for (auto o = std::next(w); o != written.end(); ++o) check(*o, "too");
    for (const MemoryOperand& r : read) check(r, "is read");
  }
}

void check_rope_inplace(const RopeCall& c) {
  check_written_memory("rope_", {{"q", &c.q}, {"k", tensor_or_null(c.k)}},
                       {{"positions", tensor_or_null(c.positions)},
                        {"offset", tensor_or_null(c.offsets)},
                        {"cu_seqlens", tensor_or_null(c.cu_seqlens)}},
                       "pass copies or use inplace=False");
}

}  // namespace ops
}  // namespace posenc
