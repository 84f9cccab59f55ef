#include "ops/cpu/cpu_support.h"

#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ops/cpu/add_position_kernel.h"

namespace posenc {
namespace ops {

namespace cpu {
bool cpu_kernels_supported() {
#if defined(POSENC_CPU_AVX2) && (defined(__x86_64__) || defined(__i386__))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return true;
#endif
}
}  // namespace cpu

void check_cpu_isa() {
  TORCH_CHECK(cpu::cpu_kernels_supported(), "posenc: the CPU kernels were built for ",
              cpu::cpu_kernels_isa(), ", which this CPU does not support; rebuild with "
              "-DPOSENC_CPU_AVX2=OFF");
}

namespace {
void advise_huge_pages(const at::Tensor& out) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // POSENC_NO_HUGE_PAGES=1 turns the advice off: on a VM whose host takes freed 2 MiB
  // blocks back (free page reporting), a huge-page output can fault in slower than 4 KiB
  // pages from the guest's hot lists (benchmarks/NOTES.md, item 7).
  static const bool off = [] {
    const char* v = std::getenv("POSENC_NO_HUGE_PAGES");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }();
  if (off) return;
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(out.mutable_data_ptr());
  const uintptr_t lo = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t hi = (begin + out.nbytes()) & ~(kHugePage - 1);
  if (out.nbytes() >= 4 * kHugePage && hi > lo) {
    // Advice only: the result is ignored (e.g. THP disabled), correctness does not depend on it.
    (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
#endif
}
}  // namespace

at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
  advise_huge_pages(out);
  return out;
}

at::Tensor empty_output_like(const at::Tensor& like) {
  at::Tensor out = at::empty_like(like, at::MemoryFormat::Preserve);
  advise_huge_pages(out);
  return out;
}

}  // namespace ops
}  // namespace posenc
