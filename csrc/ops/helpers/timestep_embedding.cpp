// posenc::timestep_embedding: diffusers' get_timestep_embedding, with the same float32
// operations in the same order (so the numbers are identical). The one definition behind
// posenc.functional.timestep_embedding (Python) and posenc::timestep_embedding (C++). Made
// of ATen ops (CompositeImplicitAutograd): differentiable in t, any device, torch.compile.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>

#include "ops/common/py_format.h"

namespace posenc {
namespace ops {
namespace {

at::Tensor timestep_embedding(const at::Tensor& t, int64_t dim, double max_period,
                              bool flip_sin_to_cos, double downscale_freq_shift, double scale) {
  constexpr const char* kFn = "timestep_embedding: expected ";
  TORCH_CHECK_VALUE(t.dim() == 1, kFn, "t to be a 1-D tensor of timesteps, got ",
                    py_tuple(t.sizes()));
  TORCH_CHECK_TYPE(!t.is_complex(), kFn, "real timesteps, got ", py_dtype(t.scalar_type()));
  TORCH_CHECK_VALUE(dim > 0, kFn, "dim to be a positive int, got ", dim);
  // NaN, inf or non-positive settings would give NaN embeddings silently.
  TORCH_CHECK_VALUE(std::isfinite(max_period) && max_period > 0.0, kFn,
                    "max_period to be a finite number > 0, got ", py_float(max_period));
  TORCH_CHECK_VALUE(std::isfinite(downscale_freq_shift), kFn,
                    "downscale_freq_shift to be a finite number, got ",
                    py_float(downscale_freq_shift));
  TORCH_CHECK_VALUE(std::isfinite(scale), kFn, "scale to be a finite number, got ",
                    py_float(scale));
  // Finite in float32 too, where the embedding is computed (1e308 is inf there: NaN columns).
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(scale)), kFn,
                    "scale to be a finite number in float32 (the embedding's dtype), got ", py_float(scale));
  const int64_t half = dim / 2;
  const double denominator = static_cast<double>(half) - downscale_freq_shift;
  // diffusers divides 0 by 0 here (e.g. dim 2 or 3 with the default shift): NaN columns.
  TORCH_CHECK_VALUE(half == 0 || denominator != 0.0, "timestep_embedding: half of dim (", half,
                    ") minus downscale_freq_shift (", py_float(downscale_freq_shift),
                    ") must not be zero");
  // The largest exponent (pair 0 or half - 1, as float32 computes them) within float32's exp:
  // past ~88.7 the frequencies are inf (max_period 1e-308: NaN columns, found by fuzzing).
  // 88 leaves room for exp's rounding; such a frequency (1.6e38) is no model's.
  if (half > 1) {
    const float top = static_cast<float>(half - 1) * static_cast<float>(-std::log(max_period)) /
                      static_cast<float>(denominator);
    TORCH_CHECK_VALUE(top <= 88.0f, "timestep_embedding: max_period ", py_float(max_period),
                      " with dim ", dim, " and downscale_freq_shift ", py_float(downscale_freq_shift),
                      " gives frequencies up to exp(", top, ") (inf in float32); expected at most exp(88)");
  }
  // diffusers, operation for operation (float32 tensors, float64 Python scalars):
  const auto float32 = at::TensorOptions().dtype(at::kFloat).device(t.device());
  at::Tensor exponent = at::arange(half, float32) * -std::log(max_period);
  if (half > 0) exponent = exponent / denominator;
  at::Tensor emb = t.unsqueeze(1).to(at::kFloat) * at::exp(exponent).unsqueeze(0);
  emb = emb * scale;
  emb = at::cat({at::sin(emb), at::cos(emb)}, -1);
  if (flip_sin_to_cos) emb = at::cat({emb.slice(1, half), emb.slice(1, 0, half)}, -1);
  if (dim % 2 == 1) emb = at::constant_pad_nd(emb, {0, 1, 0, 0}, 0);
  return emb;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (N, dim) float32 for N timesteps t: [sin | cos] halves of frequencies
  // exp(-ln(max_period) * i / (dim // 2 - downscale_freq_shift)) of scale * t, halves
  // swapped when flip_sin_to_cos, a zero column appended for an odd dim.
  m.def(
      "timestep_embedding(Tensor t, int dim, float max_period=10000.0, "
      "bool flip_sin_to_cos=False, float downscale_freq_shift=1.0, float scale=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(posenc, CompositeImplicitAutograd, m) {
  m.impl("timestep_embedding", &timestep_embedding);
}

// Under vmap the same composite, its ATen ops batched (as make_positions and
// resample_position_table): every sample's timesteps in one pass, not functorch's per-sample
// fallback.
TORCH_LIBRARY_IMPL(posenc, FuncTorchBatchedDecomposition, m) {
  m.impl("timestep_embedding", &timestep_embedding);
}

}  // namespace ops
}  // namespace posenc
