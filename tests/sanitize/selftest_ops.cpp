// Test-only ops with deliberate bugs, compiled into libposenc only in the sanitized build
// (CMake option POSENC_SANITIZER_SELFTEST, set by scripts/sanitize.sh, which refuses a
// configuration without -fsanitize=address,undefined). scripts/sanitize.sh calls each one
// through torch.ops, as the tests call the real ops, and requires that the process dies
// with the matching sanitizer report: proof that the sanitized test run can fail.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

namespace {

// Reads one element past the end of x's storage, as a kernel with an off-by-one bound
// would: AddressSanitizer reports a heap-buffer-overflow (torch's CPU allocator allocates
// exactly numel * itemsize bytes through the intercepted posix_memalign).
at::Tensor heap_overflow(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "float32, contiguous");
  const float* data = x.const_data_ptr<float>();
  float sum = 0.f;
  for (int64_t i = 0; i <= x.numel(); ++i) sum += data[i];  // <= : one too many
  return at::full({}, sum, x.options());
}

// Sums int32 values in int32: signed integer overflow (undefined behaviour) for a sum past
// INT32_MAX, which UndefinedBehaviorSanitizer reports.
at::Tensor signed_overflow(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kInt, "int32, contiguous");
  const int32_t* data = x.const_data_ptr<int32_t>();
  int32_t sum = 0;
  for (int64_t i = 0; i < x.numel(); ++i) sum += data[i];
  return at::full({}, sum, x.options());
}

}  // namespace

TORCH_LIBRARY(posenc_selftest, m) {
  m.def("heap_overflow(Tensor x) -> Tensor");
  m.def("signed_overflow(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(posenc_selftest, CPU, m) {
  m.impl("heap_overflow", &heap_overflow);
  m.impl("signed_overflow", &signed_overflow);
}
