// The op sinusoidal_table, the fixed encoding evaluated at arbitrary positions: its schema,
// argument checks, Meta kernel, the kernel composed of ATen ops, the CPU kernel and the
// CUDA registration. Autograd is in autograd.cpp, the CUDA kernel in
// cuda/sinusoidal_table/sinusoidal_table.cu.
//
// The table's dtype is an argument by name ("float64", "float32", "bfloat16", "float16", as
// torch names them without "torch."), not a ScalarType: torch 2.11's AOTInductor proxy
// executor misread ScalarType arguments of custom ops (a table came back as None). Every
// entry is evaluated in float64 and rounded once to it (a narrow dtype through float32, as
// ATen's cast of a float64 table rounds).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/common/aten_fallback.h"
#include "ops/common/py_format.h"
#include "ops/sinusoidal_table/cpu/kernel.h"
#include "posenc/math/sinusoid.h"

namespace posenc {
namespace ops {

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  m.def(
      "sinusoidal_table(Tensor positions, SymInt d_model, float base=10000.0, "
      "str dtype=\"float32\") -> Tensor");
}

namespace {

// The dtype named `name` (torch's name without "torch."): float64, float32, bfloat16 or
// float16; TypeError otherwise.
at::ScalarType table_dtype(c10::string_view name) {
  for (const at::ScalarType t : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
    if (dtype_name(t) == name) return t;
  }
  TORCH_CHECK_TYPE(false, "posenc: sinusoidal_table: expected dtype to be 'float64', 'float32', "
                   "'bfloat16' or 'float16', got ", py_str(name));
}

// The checks of every backend.
void check_sinusoidal_table_args(const at::Tensor& positions, int64_t d_model, double base) {
  TORCH_CHECK_VALUE(d_model > 0, "posenc: sinusoidal_table: expected d_model > 0, got ", d_model);
  // base <= 1 would give every column the same or a growing frequency: no longer the
  // geometric ladder of wavelengths 2 pi .. 2 pi base (RoPE refuses the same values).
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 1.0,
                    "posenc: sinusoidal_table: expected base to be a finite number > 1, got ",
                    py_float(base));
  TORCH_CHECK_TYPE(!positions.is_complex() && positions.scalar_type() != at::kBool,
                   "posenc: sinusoidal_table: expected integer or floating-point positions, got ",
                   positions.scalar_type());
}

// Column j's frequency (math::sinusoid_inv_freq) for j in [0, d_model), by the host's libm:
// the composite, the CPU and the CUDA kernels all turn by these bits.
std::vector<double> sinusoid_frequencies(int64_t d_model, double base) {
  const double log_base = std::log(base);
  std::vector<double> freq(static_cast<size_t>(d_model));
  for (int64_t j = 0; j < d_model; ++j) freq[j] = math::sinusoid_inv_freq(j, d_model, log_base);
  return freq;
}

// ---- Meta kernel: the shape (positions..., d_model) in dtype, with symbolic sizes, after
// the same argument checks as the real kernels (when d_model is concrete).
at::Tensor sinusoidal_table_meta(const at::Tensor& positions, c10::SymInt d_model, double base,
                                 c10::string_view dtype) {
  const at::ScalarType out = table_dtype(dtype);
  if (const auto d = d_model.maybe_as_int()) check_sinusoidal_table_args(positions, *d, base);
  std::vector<c10::SymInt> shape(positions.sym_sizes().begin(), positions.sym_sizes().end());
  shape.push_back(d_model);
  return at::empty_symint(shape, positions.options().dtype(out));
}

// ---- Composed from ATen ops, for backends without its kernel (the ATen fallback,
// aten_fallback.h): the frequencies of posenc/math/sinusoid.h on the host in float64, the
// angles pos * freq in float64 (float32 on MPS) and sin / cos with the device's functions,
// rounded to dtype.
at::Tensor sinusoidal_table_composite(const at::Tensor& positions, int64_t d_model, double base,
                                      c10::string_view dtype) {
  const at::ScalarType out = table_dtype(dtype);
  check_sinusoidal_table_args(positions, d_model, base);
  warn_aten_fallback("sinusoidal_table", positions.device());
  const std::vector<double> freq = sinusoid_frequencies(d_model, base);
  const at::ScalarType wide = fallback_wide_dtype(positions.device());
  const at::Tensor angle = positions.to(wide).unsqueeze(-1) *
                           at::tensor(freq, at::kDouble).to(positions.device(), wide);
  const at::Tensor odd = at::arange(d_model, positions.options().dtype(at::kLong)).remainder(2).eq(1);
  return at::where(odd, at::cos(angle), at::sin(angle)).to(at::kDouble).to(out);
}

// ---- CPU kernel: cpu/kernel.cpp, every entry libm's float64 value rounded once to dtype.
at::Tensor sinusoidal_table_cpu(const at::Tensor& positions, int64_t d_model, double base,
                                c10::string_view dtype) {
  const at::ScalarType out_dtype = table_dtype(dtype);
  check_sinusoidal_table_args(positions, d_model, base);
  const at::Tensor pos = positions.to(at::kDouble).contiguous();
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(d_model);
  at::Tensor out = at::empty(shape, positions.options().dtype(out_dtype));
  if (pos.numel() == 0) return out;
  const std::vector<double> freq = sinusoid_frequencies(d_model, base);
  SinusoidalTableArgs args;
  args.positions = pos.const_data_ptr<double>();
  args.rows = pos.numel();
  args.d_model = d_model;
  args.freq = freq.data();
  args.out = out.mutable_data_ptr();
  cpu::sinusoidal_table_stub::get()(args, out_dtype);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) { m.impl("sinusoidal_table", &sinusoidal_table_meta); }

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_composite);
}

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_cpu);
}

}  // namespace ops
}  // namespace posenc

// ---- CUDA: the same checks, then cuda/sinusoidal_table/sinusoidal_table.cu's kernel on the
// positions' device and current stream.
#if defined(POSENC_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/sinusoidal_table/launch.h"

namespace posenc {
namespace ops {
namespace {

at::Tensor sinusoidal_table_cuda(const at::Tensor& positions, int64_t d_model, double base,
                                 c10::string_view dtype) {
  const at::ScalarType out_dtype = table_dtype(dtype);
  check_sinusoidal_table_args(positions, d_model, base);
  const c10::cuda::CUDAGuard device_guard(positions.device());
  const at::Tensor pos = positions.to(at::kDouble).contiguous();
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(d_model);
  at::Tensor out = at::empty(shape, positions.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  // The host's frequencies (sinusoid_frequencies), copied from pinned memory without a sync
  // (the caching host allocator keeps the buffer until the copy has run; a block allocated
  // during CUDA graph capture is never handed out again, so a replay reads these values:
  // torch's CachingHostAllocator.h, "Leaking memory like this is intentional").
  const std::vector<double> freq = sinusoid_frequencies(d_model, base);
  at::Tensor host_freq = at::empty({d_model}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
  std::copy(freq.begin(), freq.end(), host_freq.mutable_data_ptr<double>());
  const at::Tensor device_freq = host_freq.to(positions.device(), /*non_blocking=*/true);
  C10_CUDA_CHECK(launch_sinusoidal_table(pos.const_data_ptr<double>(), device_freq.const_data_ptr<double>(),
                                         out.mutable_data_ptr(), out_dtype, out.numel(), d_model,
                                         at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_cuda);
}

}  // namespace ops
}  // namespace posenc
#endif  // POSENC_WITH_CUDA
