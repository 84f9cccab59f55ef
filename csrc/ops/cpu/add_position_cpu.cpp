// CPU kernels of add_position_forward / add_position_backward: one pass over x that adds
// the table rows and applies the dropout mask, vectorised with at::vec over d_model and
// parallel over rows with at::parallel_for. The mask comes from the shared Philox header,
// so the CPU draws exactly the mask the CUDA kernel draws for the same (seed, offset).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <type_traits>

#include "ops/add_position_checks.h"
#include "ops/kernels.h"
#include "posenc/math/philox.h"

namespace posenc {
namespace ops {
namespace {

using at::vec::Vectorized;

// Dropout state of one call, as the kernels use it.
struct DropoutDraw {
  bool active = false;
  uint64_t seed = 0;
  uint64_t offset = 0;
  math::DropoutParams params{0, 1.0};
};

// Elements are processed in chunks small enough for their keep factors to stay in L1.
constexpr int64_t kChunk = 512;

// factors[i] = scale or 0 for elements first .. first + n - 1 of the call.
template <typename acc_t>
void fill_dropout_factors(const DropoutDraw& draw, int64_t first, int64_t n, acc_t* factors) {
  const acc_t scale = static_cast<acc_t>(draw.params.scale);
  const uint32_t threshold = draw.params.threshold;
  int64_t i = 0;
  while (i < n) {
    const uint64_t e = static_cast<uint64_t>(first + i);
    const int lane0 = static_cast<int>(e % math::kDropoutBlock);
    const math::Philox4x32 bits =
        math::dropout_block_bits(draw.seed, draw.offset, e / math::kDropoutBlock);
    const int count = static_cast<int>(std::min<int64_t>(math::kDropoutBlock - lane0, n - i));
    for (int k = 0; k < count; ++k) {
      factors[i + k] = math::dropout_lane_bits(bits, lane0 + k) >= threshold ? scale : acc_t(0);
    }
    i += count;
  }
}

template <typename T, typename acc_t>
Vectorized<acc_t> load_as(const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t>) {
    return Vectorized<acc_t>::loadu(src, n);
  } else {
    alignas(64) acc_t buf[Vectorized<acc_t>::size()] = {};
    for (int64_t k = 0; k < n; ++k) buf[k] = static_cast<acc_t>(src[k]);
    return Vectorized<acc_t>::loadu(buf);
  }
}

template <typename T, typename acc_t>
void store_as(const Vectorized<acc_t>& v, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t>) {
    v.store(dst, n);
  } else {
    alignas(64) acc_t buf[Vectorized<acc_t>::size()];
    v.store(buf);
    for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<T>(buf[k]);
  }
}

// out[j] = (x[j] + t[j]) * factors[j] for j < n; t and factors may be null.
template <typename scalar_t, typename table_t, typename acc_t>
void combine(const scalar_t* x, const table_t* t, const acc_t* factors, scalar_t* out,
             int64_t n) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t kWidth = Vec::size();
  for (int64_t j = 0; j < n; j += kWidth) {
    const int64_t m = std::min<int64_t>(kWidth, n - j);
    Vec v = load_as<scalar_t, acc_t>(x + j, m);
    if (t != nullptr) v = v + load_as<table_t, acc_t>(t + j, m);
    if (factors != nullptr) v = v * Vec::loadu(factors + j, m);
    store_as<scalar_t, acc_t>(v, out + j, m);
  }
}

template <typename scalar_t, typename table_t>
void add_position_rows(const AddPositionGeometry& g, const scalar_t* x, const table_t* table,
                       const int64_t* positions, const DropoutDraw& draw, scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = g.batch * g.seq;
  const int64_t d = g.d;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    alignas(64) acc_t factors[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = g.batch_first ? r / g.seq : r % g.batch;
      const int64_t s = g.batch_first ? r % g.seq : r / g.batch;
      const int64_t pos =
          positions != nullptr ? positions[b * g.positions_batch_stride + s] : g.offset + s;
      const scalar_t* x_row = x + r * d;
      const table_t* t_row = table + pos * d;
      scalar_t* o_row = out + r * d;
      for (int64_t j = 0; j < d; j += kChunk) {
        const int64_t n = std::min(kChunk, d - j);
        if (draw.active) fill_dropout_factors<acc_t>(draw, r * d + j, n, factors);
        combine<scalar_t, table_t, acc_t>(x_row + j, t_row + j, draw.active ? factors : nullptr,
                                          o_row + j, n);
      }
    }
  });
}

// (seed, offset) for one call from the default CPU generator: a fresh 64-bit key per
// call, so torch.manual_seed reproduces runs and successive calls differ.
DropoutDraw draw_cpu(double p) {
  DropoutDraw draw;
  draw.params = math::make_dropout_params(p);
  draw.active = true;
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  draw.seed = gen->random64();
  draw.offset = 0;
  return draw;
}

at::Tensor rng_tensor(const DropoutDraw& draw) {
  if (!draw.active) return at::empty({0}, at::TensorOptions().dtype(at::kLong));
  at::Tensor rng = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  rng.data_ptr<int64_t>()[0] = static_cast<int64_t>(draw.seed);
  rng.data_ptr<int64_t>()[1] = static_cast<int64_t>(draw.offset);
  return rng;
}

DropoutDraw draw_from_rng_tensor(const at::Tensor& rng, double p) {
  TORCH_CHECK(rng.numel() == 2 && rng.scalar_type() == at::kLong,
              "posenc: expected rng to be the int64 (seed, offset) pair from the forward, got ",
              rng.scalar_type(), " of shape ", rng.sizes());
  const at::Tensor r = rng.contiguous();
  DropoutDraw draw;
  draw.active = true;
  draw.params = math::make_dropout_params(p);
  draw.seed = static_cast<uint64_t>(r.const_data_ptr<int64_t>()[0]);
  draw.offset = static_cast<uint64_t>(r.const_data_ptr<int64_t>()[1]);
  return draw;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_position_forward_cpu(
    const at::Tensor& x_in, const at::Tensor& table_in, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p) {
  const AddPositionGeometry g =
      check_add_position_inputs(x_in, table_in, positions, offset, batch_first, p);
  at::Tensor pos;
  if (positions.has_value()) {
    pos = positions->contiguous();
    check_positions_in_range_cpu(pos, g.table_len);
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor table = table_as_matrix(table_in, x.scalar_type());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const DropoutDraw draw = p > 0.0 ? draw_cpu(p) : DropoutDraw{};
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, x.scalar_type(), "posenc_add_position_cpu", [&] {
          const int64_t* pos_ptr = pos.defined() ? pos.const_data_ptr<int64_t>() : nullptr;
          if (table.scalar_type() == x.scalar_type()) {
            add_position_rows<scalar_t, scalar_t>(g, x.const_data_ptr<scalar_t>(),
                                                  table.const_data_ptr<scalar_t>(), pos_ptr,
                                                  draw, out.mutable_data_ptr<scalar_t>());
          } else {
            using wide_t = at::opmath_type<scalar_t>;
            add_position_rows<scalar_t, wide_t>(g, x.const_data_ptr<scalar_t>(),
                                                table.const_data_ptr<wide_t>(), pos_ptr, draw,
                                                out.mutable_data_ptr<scalar_t>());
          }
        });
  }
  return {out, rng_tensor(draw)};
}

at::Tensor add_position_backward_cpu(const at::Tensor& grad_in, const at::Tensor& rng, double p) {
  TORCH_CHECK(rng.device().is_cpu(), "posenc: expected rng on the CPU like grad, got ",
              rng.device());
  const DropoutDraw draw = draw_from_rng_tensor(rng, p);
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor out = at::empty(grad.sizes(), grad.options());
  const int64_t n = grad.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_add_position_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* g_ptr = grad.const_data_ptr<scalar_t>();
        scalar_t* o_ptr = out.mutable_data_ptr<scalar_t>();
        at::parallel_for(0, (n + kChunk - 1) / kChunk, 16, [&](int64_t begin, int64_t end) {
          alignas(64) acc_t factors[kChunk];
          for (int64_t c = begin; c < end; ++c) {
            const int64_t first = c * kChunk;
            const int64_t m = std::min(kChunk, n - first);
            fill_dropout_factors<acc_t>(draw, first, m, factors);
            combine<scalar_t, scalar_t, acc_t>(g_ptr + first, nullptr, factors, o_ptr + first, m);
          }
        });
      });
  return out;
}

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("add_position_forward", &add_position_forward_cpu);
  m.impl("add_position_backward", &add_position_backward_cpu);
  m.impl("sinusoidal_table", &sinusoidal_table_cpu);
}

}  // namespace ops
}  // namespace posenc
