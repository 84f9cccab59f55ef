// posenc::sinusoidal_2d_table: MAE's fixed 2-D sin-cos table (get_2d_sincos_pos_embed), with
// diffusers' rescaled coordinates (base_size, interpolation_scale: PixArt, SD3) as options.
// The one definition behind posenc.functional.sinusoidal_2d_table (Python) and
// posenc::sinusoidal_2d_table (C++), so both give the same bits. Made of ATen ops
// (CompositeImplicitAutograd): it traces under torch.compile and builds Meta tables.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "ops/common/cpu/cpu_support.h"  // kStreamBytes
#include "ops/common/float_types.h"
#include "ops/common/py_format.h"

namespace posenc {
namespace ops {
namespace {

// [sin | cos] halves of dim/2 frequencies at coords, in float64, with MAE's formula
// omega_i = 1 / base**(i / (dim/2)). (Of the two float64 forms, this one agrees with
// MAE's numpy table far more often than base**(-i / (dim/2)): the last bit of about one
// frequency in 200 against one in 3.)
at::Tensor sincos_halves(const at::Tensor& coords, int64_t dim, double base) {
  const at::Tensor exponent = at::arange(dim / 2, at::kDouble) / (dim / 2.0);
  const at::Tensor omega = at::reciprocal(at::pow(base, exponent));
  const at::Tensor angles = coords.reshape({-1, 1}) * omega;
  return at::cat({at::sin(angles), at::cos(angles)}, 1);
}

// One axis's coordinates: 0 .. n-1 (MAE), or diffusers' rescaled ones when base_size or
// interpolation_scale is set: get_2d_sincos_pos_embed's
// arange(n, float32) / (n / base_size) / interpolation_scale, the same float32 operations
// (a Python float divisor rounded to float32), so the same coordinates; then float64.
at::Tensor axis_coordinates(int64_t n, std::optional<double> base_size,
                            double interpolation_scale) {
  if (!base_size.has_value() && interpolation_scale == 1.0) return at::arange(n, at::kDouble);
  at::Tensor coords = at::arange(n, at::kFloat);
  if (base_size.has_value()) coords = coords / (static_cast<double>(n) / *base_size);
  if (interpolation_scale != 1.0) coords = coords / interpolation_scale;
  return coords.to(at::kDouble);
}

// The largest coordinate of an axis, in the same float32 arithmetic as axis_coordinates
// (division is monotonic, so it is the last one). Not finite (an underflowing or
// overflowing divisor) means inf or NaN rows, which diffusers would return silently.
bool last_coordinate_is_finite(int64_t n, std::optional<double> base_size,
                               double interpolation_scale) {
  float last = static_cast<float>(n - 1);
  if (base_size.has_value()) last = last / static_cast<float>(static_cast<double>(n) / *base_size);
  if (interpolation_scale != 1.0) last = last / static_cast<float>(interpolation_scale);
  return std::isfinite(last);
}

// The rows of a plain CPU table: zeros for the prefix, then cell (i, j)'s halves w[j] | h[i].
// A table of kStreamBytes or more (16-byte aligned halves) is written by streaming stores: a
// plain store reads each line before overwriting it, a third of the traffic of this
// write-only op (64x64x512 float32: 0.64x at 1 thread, 0.85x at 2; benchmarks/NOTES.md).
// SSE2's 16-byte streaming store is in every x86-64 build; elsewhere memcpy.
void lay_out_cpu(const at::Tensor& w, const at::Tensor& h, const at::Tensor& out, int64_t prefix, int64_t grid_w) {
  const int64_t rows = out.size(0);
  const size_t half = static_cast<size_t>(w.size(1) * w.element_size()), row = 2 * half;
  const char* wp = static_cast<const char*>(w.const_data_ptr());
  const char* hp = static_cast<const char*>(h.const_data_ptr());
  char* op = static_cast<char*>(out.mutable_data_ptr());
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / static_cast<int64_t>(std::max<size_t>(row, 1)));
#if defined(__SSE2__)
  const bool stream = static_cast<int64_t>(row) * rows >= kStreamBytes &&
                      reinterpret_cast<std::uintptr_t>(op) % 16 == 0 && half % 16 == 0;
#endif
  // n bytes from `from` to `to`, streamed when the table streams.
  const auto copy = [&](char* to, const char* from, size_t n) {
#if defined(__SSE2__)
    if (stream) {
      for (size_t i = 0; i < n; i += 16) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i)));
      }
      return;
    }
#endif
    std::memcpy(to, from, n);
  };
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      char* dst = op + static_cast<size_t>(r) * row;
      if (r < prefix) {
        std::memset(dst, 0, row);
        continue;
      }
      const int64_t cell = r - prefix;
      copy(dst, wp + static_cast<size_t>(cell % grid_w) * half, half);
      copy(dst + half, hp + static_cast<size_t>(cell / grid_w) * half, half);
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();  // before this thread's rows are handed back
#endif
  });
}

at::Tensor sinusoidal_2d_table(int64_t grid_h, int64_t grid_w, int64_t dim, double base,
                               int64_t num_prefix_tokens, std::optional<at::ScalarType> dtype,
                               std::optional<at::Device> device, std::optional<double> base_size,
                               double interpolation_scale) {
  constexpr const char* kFn = "sinusoidal_2d_table: expected ";
  TORCH_CHECK_VALUE(grid_h > 0, kFn, "grid_h to be a positive integer, got ", grid_h);
  TORCH_CHECK_VALUE(grid_w > 0, kFn, "grid_w to be a positive integer, got ", grid_w);
  TORCH_CHECK_VALUE(dim > 0, kFn, "dim to be a positive integer, got ", dim);
  TORCH_CHECK_VALUE(dim % 4 == 0, kFn, "dim to be a multiple of 4, got ", dim);
  TORCH_CHECK_VALUE(num_prefix_tokens >= 0, kFn, "num_prefix_tokens >= 0, got ", num_prefix_tokens);
  // base <= 1 gives frequencies that do not decrease (base 1: identical columns), as in
  // sinusoidal_table and RoPE.
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 1.0, kFn, "base to be a finite number > 1, got ",
                    py_float(base));
  TORCH_CHECK_VALUE(!base_size.has_value() || (std::isfinite(*base_size) && *base_size > 0.0), kFn,
                    "base_size to be None or a finite number > 0, got ",
                    base_size.has_value() ? py_float(*base_size) : std::string("None"));
  TORCH_CHECK_VALUE(std::isfinite(interpolation_scale) && interpolation_scale > 0.0, kFn,
                    "interpolation_scale to be a finite number > 0, got ",
                    py_float(interpolation_scale));
  for (const auto& [name, n] :
       {std::pair<const char*, int64_t>{"grid_h", grid_h}, {"grid_w", grid_w}}) {
    TORCH_CHECK_VALUE(last_coordinate_is_finite(n, base_size, interpolation_scale), kFn,
                      "finite float32 coordinates arange(", name, ") / (", name,
                      " / base_size) / interpolation_scale, got ", name, "=", n, ", base_size=",
                      base_size.has_value() ? py_float(*base_size) : std::string("None"),
                      ", interpolation_scale=", py_float(interpolation_scale));
  }
  const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(is_supported_float(out_dtype), kFn, "dtype to be float16, bfloat16, float32 or float64, got ",
                   py_dtype(out_dtype));
  int64_t cells = 0, rows = 0, elements = 0;
  const bool overflows = c10::mul_overflows(grid_h, grid_w, &cells) ||
                         c10::add_overflows(cells, num_prefix_tokens, &rows) ||
                         c10::mul_overflows(rows, dim, &elements);
  TORCH_CHECK_VALUE(!overflows, kFn, "num_prefix_tokens + grid_h * grid_w rows of dim columns to ",
                    "fit in int64, got ", num_prefix_tokens, " + ", grid_h, " * ", grid_w,
                    " rows of ", dim);
  // The [sin | cos] halves of each axis's distinct coordinates (grid_w for the first half of
  // the columns, grid_h for the second), built on the host in float64 and rounded once to the
  // dtype, then laid out per cell: a cell's entries are its column's and its row's, so the
  // table is the two axis tables broadcast over the grid. The bits are those of evaluating
  // every cell: an entry is a function of its angle alone (the same float64 product, ATen's
  // sin/cos, one elementwise rounding), which the test against the per-cell formula checks;
  // grid_h + grid_w rows of sin/cos instead of grid_h * grid_w.
  const auto axis = [&](int64_t n) {
    return sincos_halves(axis_coordinates(n, base_size, interpolation_scale), dim / 2, base)
        .to(out_dtype)
        .to(device.value_or(at::kCPU));
  };
  // (grid_w, dim / 2) and (grid_h, dim / 2); a square grid's axes share their coordinates.
  const at::Tensor w = axis(grid_w), h = grid_h == grid_w ? w : axis(grid_h);
  const int64_t half = dim / 2;
  // One write of every entry: the prefix rows' zeros and the cells' two halves go straight
  // into the output (a cat of the cells and then of the prefix wrote the cells twice).
  at::Tensor out = at::empty({rows, dim}, w.options());
  if (out.is_cpu() && !at::isTensorSubclassLike(out)) {
    // A plain CPU table (not traced, faked or functionalized: those take the ATen ops below):
    // each row written in one pass, its two halves copied from the axis tables' rows (the
    // ATen layout took ~20 calls, two strided copies among them: ~half of a cold call).
    lay_out_cpu(w.contiguous(), h.contiguous(), out, num_prefix_tokens, grid_w);
    return out;
  }
  if (num_prefix_tokens > 0) out.narrow(0, 0, num_prefix_tokens).zero_();
  const at::Tensor grid = out.narrow(0, num_prefix_tokens, cells).view({grid_h, grid_w, dim});
  grid.narrow(2, 0, half).copy_(w.unsqueeze(0).expand({grid_h, grid_w, half}));
  grid.narrow(2, half, half).copy_(h.unsqueeze(1).expand({grid_h, grid_w, half}));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (num_prefix_tokens + grid_h * grid_w, dim): zero rows for the prefix (class) tokens,
  // then the patches in row-major (h, w) order; dtype float32 unless given. base_size and
  // interpolation_scale rescale the coordinates as diffusers' PixArt / SD3 tables do:
  // arange(n) / (n / base_size) / interpolation_scale per axis (None, 1.0: arange(n)).
  m.def(
      "sinusoidal_2d_table(int grid_h, int grid_w, int dim, float base=10000.0, "
      "int num_prefix_tokens=0, ScalarType? dtype=None, Device? device=None, "
      "float? base_size=None, float interpolation_scale=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(posenc, CompositeImplicitAutograd, m) {
  m.impl("sinusoidal_2d_table", &sinusoidal_2d_table);
}

}  // namespace ops
}  // namespace posenc
