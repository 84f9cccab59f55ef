// The op sinusoidal_table, the fixed encoding evaluated at arbitrary positions: its schema,
// argument checks, Meta kernel, the kernel composed of ATen ops, the CPU kernel and the
// CUDA registration. Autograd is in autograd.cpp, the CUDA kernel in
// cuda/sinusoidal_table/sinusoidal_table.cu.
//
// The table ops compute and return float64; the front ends (posenc::sinusoidal_table,
// posenc.functional.sinusoidal_table) round it once to the dtype asked for with an ATen cast,
// so no ScalarType argument has to travel through an exported graph (torch 2.11's AOTInductor
// proxy executor misread them: a table came back as None).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/common/aten_fallback.h"
#include "posenc/math/sinusoid.h"

namespace posenc {
namespace ops {

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  m.def(
      "sinusoidal_table(Tensor positions, SymInt d_model, float base=10000.0) -> Tensor");
}

namespace {

// The checks of every backend.
void check_sinusoidal_table_args(const at::Tensor& positions, int64_t d_model, double base) {
  TORCH_CHECK_VALUE(d_model > 0, "posenc: expected d_model > 0, got ", d_model);
  // base <= 1 would give every column the same or a growing frequency: no longer the
  // geometric ladder of wavelengths 2 pi .. 2 pi base (RoPE refuses the same values).
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 1.0,
                    "posenc: expected base to be a finite number > 1, got ", base);
  TORCH_CHECK_TYPE(!positions.is_complex() && positions.scalar_type() != at::kBool,
                   "posenc: expected integer or floating-point positions, got ",
                   positions.scalar_type());
}

// ---- Meta kernel: the shape (positions..., d_model), float64, with symbolic sizes, after
// the same argument checks as the real kernels (when d_model is concrete).
at::Tensor sinusoidal_table_meta(const at::Tensor& positions, c10::SymInt d_model, double base) {
  if (const auto d = d_model.maybe_as_int()) check_sinusoidal_table_args(positions, *d, base);
  std::vector<c10::SymInt> shape(positions.sym_sizes().begin(), positions.sym_sizes().end());
  shape.push_back(d_model);
  return at::empty_symint(shape, positions.options().dtype(at::kDouble));
}

// ---- Composed from ATen ops, for backends without its kernel (the ATen fallback,
// aten_fallback.h): the frequencies of posenc/math/sinusoid.h on the host in float64, the
// angles pos * freq in float64 (float32 on MPS) and sin / cos with the device's functions,
// returned in float64 as the kernels' tables are.
at::Tensor sinusoidal_table_composite(const at::Tensor& positions, int64_t d_model, double base) {
  check_sinusoidal_table_args(positions, d_model, base);
  warn_aten_fallback("sinusoidal_table", positions.device());
  const double log_base = std::log(base);
  std::vector<double> freq(static_cast<size_t>(d_model));
  for (int64_t j = 0; j < d_model; ++j) freq[j] = math::sinusoid_inv_freq(j, d_model, log_base);
  const at::ScalarType wide = fallback_wide_dtype(positions.device());
  const at::Tensor angle = positions.to(wide).unsqueeze(-1) *
                           at::tensor(freq, at::kDouble).to(positions.device(), wide);
  const at::Tensor odd = at::arange(d_model, positions.options().dtype(at::kLong)).remainder(2).eq(1);
  return at::where(odd, at::cos(angle), at::sin(angle)).to(at::kDouble);
}

// ---- CPU kernel: every entry evaluated in double precision by the shared header and
// stored as it is (float64: the front ends round it once to the dtype asked for).
at::Tensor sinusoidal_table_cpu(const at::Tensor& positions, int64_t d_model, double base) {
  check_sinusoidal_table_args(positions, d_model, base);
  const at::Tensor pos = positions.to(at::kDouble).contiguous();
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(d_model);
  at::Tensor out = at::empty(shape, positions.options().dtype(at::kDouble));
  const int64_t rows = pos.numel();
  if (rows == 0) return out;
  const double log_base = std::log(base);
  const double* p = pos.const_data_ptr<double>();
  double* o = out.mutable_data_ptr<double>();
  // math::sinusoid_value entry by entry, with its frequency computed once per column and
  // each column pair's angle once: sin and cos of one angle, which the compiler fuses into
  // one sincos call (glibc's gives sin's and cos's bits: checked on 20M angles): half the
  // libm work, the same numbers.
  std::vector<double> freq(static_cast<size_t>(d_model));
  for (int64_t j = 0; j < d_model; ++j) freq[j] = math::sinusoid_inv_freq(j, d_model, log_base);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d_model), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      double* row = o + r * d_model;
      int64_t j = 0;
      for (; j + 1 < d_model; j += 2) {
        const double angle = p[r] * freq[j];  // the pair's frequency (columns 2i and 2i + 1)
        row[j] = std::sin(angle);
        row[j + 1] = std::cos(angle);
      }
      if (j < d_model) row[j] = std::sin(p[r] * freq[j]);  // odd d: a last sine column
    }
  });
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

at::Tensor sinusoidal_table_cuda(const at::Tensor& positions, int64_t d_model, double base) {
  check_sinusoidal_table_args(positions, d_model, base);
  const c10::cuda::CUDAGuard device_guard(positions.device());
  const at::Tensor pos = positions.to(at::kDouble).contiguous();
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(d_model);
  at::Tensor out = at::empty(shape, positions.options().dtype(at::kDouble));
  C10_CUDA_CHECK(launch_sinusoidal_table(pos.const_data_ptr<double>(), out.mutable_data_ptr<double>(), out.numel(),
                                         d_model, std::log(base), at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("sinusoidal_table", &sinusoidal_table_cuda);
}

}  // namespace ops
}  // namespace posenc
#endif  // POSENC_WITH_CUDA
