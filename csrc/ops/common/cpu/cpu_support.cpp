#include "ops/common/cpu/cpu_support.h"

#include <ATen/EmptyTensor.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sys/mman.h>
#endif

namespace posenc {
namespace ops {

namespace {

// Where the CPU ops' large outputs come from (POSENC_CPU_OUTPUTS, read once per process).
// A fresh output of 32 MiB or more is a fresh mmap from glibc: ~8000 page faults per
// 32 MiB, which take longer than the kernel that writes it (benchmarks/NOTES.md, CPU).
//  - reuse (default): outputs of >= 32 MiB come from a small cache of blocks freed by
//    earlier outputs, so a loop's pages are faulted once, on 4 KiB pages, whatever the
//    kernel's huge-page settings; no advice to the kernel.
//  - fresh: torch's allocator, as any ATen op (POSENC_NO_HUGE_PAGES=1, the old switch,
//    means this too).
//  - huge: the former default, fresh outputs advised onto transparent huge pages. Fast when
//    the kernel has huge pages at hand, up to 2x slower than fresh when it must compact
//    memory or the host must back them (defrag=madvise, VMs with free page reporting).
enum class OutputMemory { kReuse, kFresh, kHuge };

bool env_flag_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

OutputMemory read_output_memory() {
  const char* v = std::getenv("POSENC_CPU_OUTPUTS");
  if (v != nullptr && *v != '\0') {
    const std::string s(v);
    if (s == "reuse") return OutputMemory::kReuse;
    if (s == "fresh") return OutputMemory::kFresh;
    if (s == "huge") return OutputMemory::kHuge;
    TORCH_CHECK_VALUE(false, "posenc: expected POSENC_CPU_OUTPUTS to be reuse, fresh or huge, got '",
                      s, "'");
  }
  if (env_flag_set("POSENC_NO_HUGE_PAGES")) return OutputMemory::kFresh;
#if defined(__SANITIZE_ADDRESS__)
  return OutputMemory::kFresh;  // mmap'ed blocks would hide overflows from AddressSanitizer
#else
  return OutputMemory::kReuse;
#endif
}

OutputMemory output_memory() {
  static const OutputMemory policy = read_output_memory();
  return policy;
}

// glibc serves smaller blocks from its heap once one of their size was freed (its mmap
// threshold rises to that size), i.e. on pages faulted in already; from 32 MiB on
// (DEFAULT_MMAP_THRESHOLD_MAX) every block is a fresh mmap. So only those are cached: a
// miss here is the same fresh mmap glibc would make, never colder memory than glibc's.
constexpr size_t kReuseMinBytes = size_t{32} << 20;

#if defined(__linux__)
// The blocks of freed outputs, kept mapped (and their pages faulted in) for the next
// output of about the same size. Bounded: at most kMaxBlocks blocks and kMaxBytes bytes
// wait here; beyond that the oldest are unmapped. A block serves a request of up to 1/8
// less than its size.
class OutputBlockCache final : public c10::Allocator {
 public:
  static constexpr size_t kMaxBlocks = 8;
  static constexpr size_t kMaxBytes = size_t{256} << 20;
  static constexpr size_t kGranule = size_t{64} << 10;

  static OutputBlockCache& get() {
    static auto* cache = [] {
      auto* made = new OutputBlockCache();  // never destroyed: outputs may outlive statics
      // A fork while another thread holds the lock would leave it held in the child.
      pthread_atfork([] { get().mutex_.lock(); }, [] { get().mutex_.unlock(); },
                     [] { get().mutex_.unlock(); });
      return made;
    }();
    return *cache;
  }

  c10::DataPtr allocate(size_t n) override {
    const size_t bytes = (std::max(n, size_t{1}) + kGranule - 1) / kGranule * kGranule;
    void* data = take(bytes);  // a cached block stays registered in live_
    if (data == nullptr) {
      data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK(data != MAP_FAILED, "posenc: could not map ", bytes, " bytes for a CPU output");
      std::lock_guard<std::mutex> lock(mutex_);
      live_[data] = bytes;
    }
    return {data, data, &OutputBlockCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &OutputBlockCache::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  struct Block {
    void* data;
    size_t bytes;
  };

  // The smallest cached block that fits `bytes` with at most 1/8 to spare, or nullptr.
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const size_t have = free_[i].bytes;
      if (have >= bytes && have - bytes <= bytes / 8 &&
          (best == free_.size() || have < free_[best].bytes)) {
        best = i;
      }
    }
    if (best == free_.size()) return nullptr;
    void* data = free_[best].data;
    free_bytes_ -= free_[best].bytes;
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
    return data;
  }

  static void release(void* data) { get().put(data); }

  void put(void* data) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = live_.find(data);
      // A deleter runs inside destructors (noexcept): an exception here would terminate the
      // process. Every pointer handed out is in live_, so this cannot happen; if it ever
      // did, its size is unknown and nothing can be unmapped.
      if (it == live_.end()) return;
      const Block block{data, it->second};
      if (block.bytes > kMaxBytes || block.bytes < kReuseMinBytes) {  // e.g. after a resize_
        live_.erase(it);
        evicted.push_back(block);
      } else {
        free_.push_back(block);  // newest last
        free_bytes_ += block.bytes;
        while (free_.size() > kMaxBlocks || free_bytes_ > kMaxBytes) {
          evicted.push_back(free_.front());
          free_bytes_ -= free_.front().bytes;
          live_.erase(free_.front().data);
          free_.erase(free_.begin());
        }
      }
    }
    for (const Block& b : evicted) munmap(b.data, b.bytes);  // outside the lock
  }

 public:
  // Unmaps every cached free block; returns their bytes. Blocks in use are untouched.
  int64_t release_free() {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      evicted.swap(free_);
      for (const Block& b : evicted) live_.erase(b.data);
      free_bytes_ = 0;
    }
    int64_t bytes = 0;
    for (const Block& b : evicted) {
      munmap(b.data, b.bytes);
      bytes += static_cast<int64_t>(b.bytes);
    }
    return bytes;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, size_t> live_;  // every mapped block (in use or free) and its size
  std::vector<Block> free_;                 // freed blocks, oldest first
  size_t free_bytes_ = 0;
};
#endif

void advise_huge_pages(const at::Tensor& out) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
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

// The reused-block allocator for an output of `bytes`, or nullptr for torch's own.
c10::Allocator* reuse_allocator(size_t bytes, const at::TensorOptions& options) {
#if defined(__linux__)
  if (output_memory() == OutputMemory::kReuse && bytes >= kReuseMinBytes &&
      options.device().is_cpu() && options.layout() == at::kStrided && !options.pinned_memory()) {
    return &OutputBlockCache::get();
  }
#endif
  return nullptr;
}

}  // namespace

int64_t empty_cpu_output_cache() {
#if defined(__linux__)
  // Only touch the cache if it exists: creating it here would be pointless.
  if (output_memory() == OutputMemory::kReuse) return OutputBlockCache::get().release_free();
#endif
  return 0;
}

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // Gives the blocks that the CPU output cache (POSENC_CPU_OUTPUTS=reuse) keeps for the next
  // large output back to the system, as torch.cuda.empty_cache() does for CUDA's cache;
  // returns the bytes unmapped. No tensor: one kernel for every backend.
  m.def("empty_cpu_output_cache() -> int", &empty_cpu_output_cache);
}

at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) *
                       c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (c10::Allocator* allocator = reuse_allocator(bytes, options)) {
    return at::Tensor(at::detail::empty_generic(sizes, allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                c10::typeMetaToScalarType(options.dtype()),
                                                options.memory_format_opt()));
  }
  at::Tensor out = at::empty(sizes, options);
  if (output_memory() == OutputMemory::kHuge) advise_huge_pages(out);
  return out;
}

at::Tensor empty_output_like(const at::Tensor& like) {
  if (c10::Allocator* allocator = reuse_allocator(like.nbytes(), like.options())) {
    // empty_like's Preserve: like's strides when dense, contiguous otherwise.
    const c10::DispatchKeySet cpu(c10::DispatchKey::CPU);
    return at::Tensor(like.is_non_overlapping_and_dense()
                          ? at::detail::empty_strided_generic(like.sizes(), like.strides(),
                                                              allocator, cpu, like.scalar_type())
                          : at::detail::empty_generic(like.sizes(), allocator, cpu,
                                                      like.scalar_type(),
                                                      like.suggest_memory_format()));
  }
  at::Tensor out = at::empty_like(like, at::MemoryFormat::Preserve);
  if (output_memory() == OutputMemory::kHuge) advise_huge_pages(out);
  return out;
}

}  // namespace ops
}  // namespace posenc
