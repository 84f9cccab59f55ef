// CUDA kernels of add_position_backward_with_table: grad read once, grad_x = grad * mask *
// scale written, and the same values summed into the table in a fixed order (deterministic,
// no atomics).
// - Positions that depend on the sequence index only (offset, or (seq,) positions): a block
//   per (s, tile of up to 32 groups of 8 columns); its threads split the batch into
//   contiguous slices (256 / tile width of them), each summing its slice in order, and the
//   slices are added in slice order through shared memory: a fixed order, and
//   seq * d / 8 * slices threads instead of seq * d / 8 (too few for 132 SMs at
//   (32, 512, 512): 128 blocks; ViT's (256, 197, 768): 74). Without positions the sums land
//   straight in their table rows (offset + s, all distinct); with (seq,) positions, which
//   may repeat, they go to a (seq, d) buffer reduced into the table by index_put (sort
//   based: deterministic too; unchecked out-of-range positions add nothing, see
//   scatter_rows_into_table).
// - (batch, seq) positions: the rows are sorted (stably) by table row and each run of equal
//   rows is summed in fixed order in two passes over chunks of the sorted order (long runs
//   split over many threads, see ops/common/sorted_runs.h); pass 1 also writes grad_x.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/add_position/add_position.h"
#include "ops/common/cuda_work_split.h"
#include "ops/common/sorted_runs.h"
#include "posenc/math/philox.h"
#include "../common/vector_access.cuh"

namespace posenc {
namespace ops {
namespace {

using cuda::is_aligned16;
using cuda::store_group;

constexpr int kThreads = 256;
constexpr int kGroup = math::kDropoutBlock;  // 8 columns per thread

struct TableBackwardArgs {
  int64_t batch, seq, d;
  bool batch_first;
  const int64_t* rng;  // (seed, offset) on the device; null when p == 0
  uint32_t threshold;
  double scale;
};

// One thread's running sums for 8 columns j0 .. j0+7 of the table gradient, over the rows
// it is given in a fixed order. add_row writes the row's masked gradient to grad_x (when
// wanted) and adds it to the sums. kAligned: d % 8 == 0 and 16-byte aligned pointers, so
// the 8 columns are one Philox block and two 16-byte accesses at most; otherwise element
// by element, one Philox call per dropout block touched.
template <typename scalar_t, bool kAligned>
struct ColumnGroupSum {
  using acc_t = at::opmath_type<scalar_t>;
  // Only what the loop reads (a copy of the whole argument struct costs registers).
  const int64_t d, j0;
  const bool dropout;
  const uint32_t threshold;
  uint64_t seed = 0, offset = 0;
  const acc_t scale;
  acc_t acc[kGroup];

  __device__ ColumnGroupSum(const TableBackwardArgs& args, int64_t first_column)
      : d(args.d),
        j0(first_column),
        dropout(args.rng != nullptr),
        threshold(args.threshold),
        scale(static_cast<acc_t>(args.scale)) {
    if (dropout) {
      seed = static_cast<uint64_t>(args.rng[0]);
      offset = static_cast<uint64_t>(args.rng[1]);
    }
#pragma unroll
    for (int k = 0; k < kGroup; ++k) acc[k] = acc_t(0);
  }

  // The aligned path in two steps, so that a caller can have two rows' loads in flight:
  // load (two 16-byte loads at most), then add (mask, grad_x, sums).
  __device__ __forceinline__ cuda::RawGroup<scalar_t> load(const scalar_t* __restrict__ grad,
                                                           int64_t row) const {
    return cuda::load_raw_group(grad + row * d + j0);
  }

  __device__ __forceinline__ void add(const cuda::RawGroup<scalar_t>& raw,
                                      scalar_t* __restrict__ grad_x, int64_t row) {
    const int64_t e0 = row * d + j0;
    acc_t v[kGroup];
    cuda::convert_group(raw, v);
    if (dropout) {
      const math::Philox4x32 bits = math::dropout_block_bits(seed, offset, e0 / kGroup);
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        v[k] *= math::dropout_lane_bits(bits, k) >= threshold ? scale : acc_t(0);
      }
    }
    if (grad_x != nullptr) store_group<scalar_t, acc_t>(grad_x + e0, v);
#pragma unroll
    for (int k = 0; k < kGroup; ++k) acc[k] += v[k];
  }

  __device__ __forceinline__ void add_row(const scalar_t* __restrict__ grad,
                                          scalar_t* __restrict__ grad_x, int64_t row) {
    const int64_t e0 = row * d + j0;
    if (kAligned) {
      add(load(grad, row), grad_x, row);
    } else {
      uint64_t block = ~uint64_t{0};
      math::Philox4x32 bits{};
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        if (j0 + k >= d) break;
        const int64_t e = e0 + k;
        acc_t v = static_cast<acc_t>(grad[e]);
        if (dropout) {
          const uint64_t e_block = static_cast<uint64_t>(e) / kGroup;
          if (e_block != block) {
            bits = math::dropout_block_bits(seed, offset, e_block);
            block = e_block;
          }
          v *= math::dropout_lane_bits(bits, static_cast<int>(e % kGroup)) >= threshold
                   ? scale
                   : acc_t(0);
        }
        if (grad_x != nullptr) grad_x[e] = static_cast<scalar_t>(v);
        acc[k] += v;
      }
    }
  }

  // The sums into row `out` (of d columns).
  __device__ __forceinline__ void store(acc_t* __restrict__ out) const {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      if (j0 + k < d) out[j0 + k] = acc[k];
    }
  }
};

// Positions that depend on s only. Block (tile, slices) = blockDim (x, y): thread (x, y)
// sums column group tile * width + x of position s over batch slice y, rows in batch
// order; then the slice sums are added in slice order, one thread per column, and stored.
// Register budget: 4 blocks of 256 threads per SM (64 registers) on the 16-byte paths, two
// rows' loads in flight (one for float64, whose row group is already four 16-byte loads);
// 2 blocks (128 registers) for the element-wise fallback and float64, which spilled at 64.
template <typename scalar_t, bool kAligned>
constexpr int kTableMinBlocksPerSm = kAligned && sizeof(scalar_t) <= 4 ? 4 : 2;

template <typename scalar_t, bool kAligned>
__global__ void __launch_bounds__(kThreads, (kTableMinBlocksPerSm<scalar_t, kAligned>))
    add_position_backward_table_kernel(const scalar_t* __restrict__ grad,
                                       scalar_t* __restrict__ grad_x,
                                       at::opmath_type<scalar_t>* __restrict__ sums,
                                       TableBackwardArgs args, int64_t tiles_per_row) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t partial[kThreads * kGroup];
  const int64_t groups_per_row = (args.d + kGroup - 1) / kGroup;
  const int64_t s = blockIdx.x / tiles_per_row;
  const int64_t tile = blockIdx.x - s * tiles_per_row;
  const int width = blockDim.x, slices = blockDim.y;
  const int64_t group = tile * width + threadIdx.x;
  int64_t b_begin, b_end;
  table_batch_slice(args.batch, slices, threadIdx.y, &b_begin, &b_end);
  ColumnGroupSum<scalar_t, kAligned> sum(args, group * kGroup);
  if (group < groups_per_row) {
    // Batch order within the slice; two rows' loads in flight on the aligned path.
    const int64_t b_step = args.batch_first ? args.seq : 1;
    const int64_t first = args.batch_first ? s : s * args.batch;
    int64_t b = b_begin;
    if constexpr (kAligned && sizeof(scalar_t) <= 4) {  // float64 rows: one at a time (spills)
      for (; b + 1 < b_end; b += 2) {
        const int64_t r0 = first + b * b_step, r1 = r0 + b_step;
        const cuda::RawGroup<scalar_t> g0 = sum.load(grad, r0);
        const cuda::RawGroup<scalar_t> g1 = sum.load(grad, r1);
        sum.add(g0, grad_x, r0);
        sum.add(g1, grad_x, r1);
      }
    }
    for (; b < b_end; ++b) sum.add_row(grad, grad_x, first + b * b_step);
  }
  const int t = threadIdx.y * width + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kGroup; ++k) partial[t * kGroup + k] = sum.acc[k];
  __syncthreads();
  // Column c of the tile (group c / 8, lane c % 8): the slices in order.
  const int c = t;
  const int64_t j = tile * width * kGroup + c;
  if (c < width * kGroup && j < args.d) {
    acc_t total = partial[c];
    for (int y = 1; y < slices; ++y) total += partial[y * width * kGroup + c];
    sums[s * args.d + j] = total;
  }
}

// (batch, seq) positions: the memory rows sorted (stably) by their table row, so the rows
// of one table row form a run, summed in two passes (csrc/ops/common/sorted_runs.h): long runs
// (padding positions shared across a batch) are split over many threads, and every sum
// still runs in a fixed order. Keys equal to table_len mark positions outside the table
// (possible only unchecked, on CUDA): their rows get grad_x and add nothing.
//
// Pass 1: one thread per (segment, group of 8 columns), a segment being the equal keys of
// one chunk. It writes grad_x of the segment's rows (every row lies in exactly one
// segment: grad_x written once, grad read once) and stores the sum in the table row, or,
// for a run crossing chunk boundaries, in its chunk's start or carry partial.
template <typename scalar_t, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    add_position_backward_table_sorted_kernel(const scalar_t* __restrict__ grad,
                                              scalar_t* __restrict__ grad_x,
                                              at::opmath_type<scalar_t>* __restrict__ table,
                                              at::opmath_type<scalar_t>* __restrict__ start,
                                              at::opmath_type<scalar_t>* __restrict__ carry,
                                              SortedRuns runs, const int64_t* __restrict__ rows,
                                              int64_t table_len, TableBackwardArgs args) {
  const int64_t groups_per_row = (args.d + kGroup - 1) / kGroup;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (tid >= runs.slots * groups_per_row) return;
  const int64_t first = tid / groups_per_row;
  if (!segment_begins(runs, first)) return;
  const int64_t end = segment_end(runs, first);
  ColumnGroupSum<scalar_t, kAligned> sum(args, (tid - first * groups_per_row) * kGroup);
  for (int64_t i = first; i < end; ++i) sum.add_row(grad, grad_x, rows[i]);
  const int64_t key = runs.keys[first];
  const int64_t chunk = first / runs.chunk;
  switch (segment_role(runs, first, end)) {
    case SegmentRole::kWholeRun:
      if (key < table_len) sum.store(table + key * args.d);
      break;
    case SegmentRole::kRunStart:
      sum.store(start + chunk * args.d);
      break;
    case SegmentRole::kContinuation:
      sum.store(carry + chunk * args.d);
      break;
  }
}

// Pass 2: one thread per (chunk, group of 8 columns) whose chunk starts a crossing run:
// its start partial plus the carries of the following chunks, in chunk order.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    add_position_backward_table_runs_kernel(acc_t* __restrict__ table,
                                            const acc_t* __restrict__ start,
                                            const acc_t* __restrict__ carry, SortedRuns runs,
                                            int64_t table_len, int64_t d) {
  const int64_t groups_per_row = (d + kGroup - 1) / kGroup;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t chunks = runs.chunks();
  if (tid >= chunks * groups_per_row) return;
  const int64_t c = tid / groups_per_row;
  if (!chunk_starts_crossing_run(runs, c)) return;
  const int64_t key = runs.keys[runs.chunk_end(c) - 1];
  if (key >= table_len) return;  // positions outside the table add nothing
  const int64_t j0 = (tid - c * groups_per_row) * kGroup;
  const int64_t width = d - j0 < kGroup ? d - j0 : kGroup;
  acc_t acc[kGroup];
#pragma unroll
  for (int k = 0; k < kGroup; ++k) acc[k] = k < width ? start[c * d + j0 + k] : acc_t(0);
  for (int64_t j = c + 1; j < chunks && runs.keys[j * runs.chunk] == key; ++j) {
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      if (k < width) acc[k] += carry[j * d + j0 + k];
    }
  }
#pragma unroll
  for (int k = 0; k < kGroup; ++k) {
    if (k < width) table[key * d + j0 + k] = acc[k];
  }
}

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_cuda(
    const at::Tensor& grad_in, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, int64_t table_len, bool need_x) {
  const AddPositionArgs g = check_add_position_backward_inputs(
      grad_in, rng, positions, offset, batch_first, p, table_len);
  const c10::cuda::CUDAGuard device_guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::ScalarType acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_x = need_x ? at::empty(grad.sizes(), grad.options())
                             : at::empty({0}, grad.options());
  const bool sorted = positions.has_value() && positions->dim() == 2;
  // The table gradient starts at zero, except on the (seq,) positions path, which builds it
  // from the per-s sums (scatter_rows_into_table) and would discard a zeroed table.
  at::Tensor grad_table;
  if (grad.numel() == 0 || !positions.has_value() || sorted) {
    grad_table = at::zeros({table_len, g.d}, grad.options().dtype(acc));
  }
  if (grad.numel() == 0) return {grad_x, grad_table};
  const auto params = math::make_dropout_params(p);
  const at::Tensor state = p > 0.0 ? rng.contiguous() : at::Tensor();
  TableBackwardArgs args{g.batch, g.seq, g.d, g.batch_first,
                         p > 0.0 ? state.const_data_ptr<int64_t>() : nullptr, params.threshold,
                         params.scale};
  const int64_t groups_per_row = (g.d + kGroup - 1) / kGroup;
  const auto stream = at::cuda::getCurrentCUDAStream();

  // (batch, seq) positions: each memory row's table row (table_len for one outside the
  // table), sorted stably; the two passes sum each run of equal keys.
  at::Tensor keys, rows, start, carry;
  SortedRuns runs{nullptr, 0, 1};
  if (sorted) {
    const at::Tensor pos = batch_first ? *positions : positions->t();  // memory-row order
    at::Tensor flat = pos.reshape({-1});
    flat = at::where(flat.ge(0).logical_and(flat.lt(table_len)), flat, table_len);
    std::tie(keys, rows) = at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    runs = SortedRuns{keys.const_data_ptr<int64_t>(), g.batch * g.seq,
                      sorted_runs_chunk(g.batch * g.seq)};
    start = at::empty({runs.chunks(), g.d}, grad.options().dtype(acc));
    carry = at::empty({runs.chunks(), g.d}, grad.options().dtype(acc));
  }
  // Sums per s: straight into rows offset + s of the table, or into a buffer when the
  // (seq,) positions may send two s to one row.
  at::Tensor sums;
  if (!sorted) {
    sums = positions.has_value() ? at::empty({g.seq, g.d}, grad.options().dtype(acc))
                                 : grad_table.narrow(0, offset, g.seq);
  }
  const int64_t threads = (sorted ? g.batch * g.seq : g.seq) * groups_per_row;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_add_position_backward_table_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        scalar_t* gx = need_x ? grad_x.mutable_data_ptr<scalar_t>() : nullptr;
        const bool aligned = g.d % kGroup == 0 && is_aligned16(grad.const_data_ptr()) &&
                             (gx == nullptr || is_aligned16(gx));
        if (sorted) {
          auto kernel = aligned ? add_position_backward_table_sorted_kernel<scalar_t, true>
                                : add_position_backward_table_sorted_kernel<scalar_t, false>;
          kernel<<<blocks, kThreads, 0, stream>>>(
              grad.const_data_ptr<scalar_t>(), gx, grad_table.mutable_data_ptr<acc_t>(),
              start.mutable_data_ptr<acc_t>(), carry.mutable_data_ptr<acc_t>(), runs,
              rows.const_data_ptr<int64_t>(), table_len, args);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          const int64_t run_threads = runs.chunks() * groups_per_row;
          add_position_backward_table_runs_kernel<acc_t>
              <<<(run_threads + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
                  grad_table.mutable_data_ptr<acc_t>(), start.const_data_ptr<acc_t>(),
                  carry.const_data_ptr<acc_t>(), runs, table_len, g.d);
        } else {
          auto kernel = aligned ? add_position_backward_table_kernel<scalar_t, true>
                                : add_position_backward_table_kernel<scalar_t, false>;
          // Tile width: the row's column groups, up to a warp's 32 (a warp then reads 512
          // contiguous bytes of bf16 rows); the rest of the 256 threads split the batch.
          const TableTiles tiles = table_tiles(groups_per_row, kThreads);
          const dim3 block(tiles.width, tiles.slices);
          kernel<<<g.seq * tiles.tiles_per_row, block, 0, stream>>>(
              grad.const_data_ptr<scalar_t>(), gx, sums.mutable_data_ptr<acc_t>(), args,
              tiles.tiles_per_row);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  if (positions.has_value() && !sorted) {
    grad_table = scatter_rows_into_table(positions->contiguous(), sums, table_len);
  }
  return {grad_x, grad_table};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("add_position_backward_with_table", &add_position_backward_with_table_cuda);
}

}  // namespace ops
}  // namespace posenc
