// CUDA kernels of add_position_forward, add_position_backward and
// add_position_backward_with_table, and their launchers (launch.h).
//
// One thread handles a group of 8 consecutive output elements per step: exactly one
// Philox call (see posenc/math/philox.h) and, on the fast path, 16-byte loads and stores.
// The fast path needs d % 8 == 0 (a group never straddles two rows) and 16-byte aligned
// pointers; offset views and odd sizes take the element-wise path, which draws the same
// mask. Indices are 32-bit when the tensor allows, 64-bit otherwise.
//
// The dropout (seed, offset) comes from the device's default generator as a
// PhiloxCudaState, unpacked inside the kernel (so CUDA graph capture works), and the
// kernel writes the pair to the small `rng` output that backward reads on the device:
// no host-device synchronisation anywhere.
//
// add_position_backward_with_table: grad read once, grad_x = grad * mask *
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
#include <c10/macros/Macros.h>  // C10_HOST_DEVICE, which IntegerDivider.cuh uses without including it
#include <ATen/cuda/PhiloxUtils.cuh>  // at::cuda::philox::unpack
#include <ATen/cuda/detail/IntegerDivider.cuh>

#include <algorithm>
#include <limits>

#include "../common/occupancy.cuh"
#include "../common/vector_access.cuh"
#include "launch.h"
#include "ops/common/cuda_work_split.h"
#include "ops/common/sorted_runs.h"
#include "posenc/math/philox.h"

namespace posenc {
namespace ops {
namespace {

using cuda::is_aligned16;
using cuda::store_group;
using at::cuda::detail::IntDivider;

constexpr int kThreads = 256;
constexpr int kGroup = math::kDropoutBlock;

template <typename index_t>
struct RowMap {
  IntDivider<index_t> d;      // element -> (row, column)
  IntDivider<index_t> inner;  // row -> (outer, inner): (b, s) or (s, b)
  bool batch_first;
  const int64_t* positions;  // null: position = offset + s
  int64_t positions_batch_stride;
  int64_t offset;
  int64_t table_len;

  // Table row for output row `row`. A position outside [0, table_len) stops the kernel with
  // a device-side assert (the CPU kernel's IndexError; ATen's indexing does the same): the
  // error surfaces at the next synchronisation, and the CUDA context is unusable after it.
  // Checked on the device so that the default call needs no host sync (graph capture).
  __device__ __forceinline__ int64_t position(index_t row) const {
    const auto qr = inner.divmod(row);
    const index_t b = batch_first ? qr.div : qr.mod;
    const index_t s = batch_first ? qr.mod : qr.div;
    const int64_t pos = positions != nullptr
                            ? positions[static_cast<int64_t>(b) * positions_batch_stride + s]
                            : offset + static_cast<int64_t>(s);
    CUDA_KERNEL_ASSERT_MSG(pos >= 0 && pos < table_len,
                           "posenc: add_position: a position is outside [0, max_len) of the table");
    return pos;
  }
};

template <typename acc_t>
__device__ __forceinline__ void dropout_factors(uint64_t seed, uint64_t offset, uint64_t group,
                                                uint32_t threshold, acc_t scale,
                                                acc_t (&factors)[kGroup]) {
  const math::Philox4x32 bits = math::dropout_block_bits(seed, offset, group);
#pragma unroll
  for (int k = 0; k < kGroup; ++k) {
    factors[k] = math::dropout_lane_bits(bits, k) >= threshold ? scale : acc_t(0);
  }
}

// Fast path: kUnroll<scalar_t> groups per thread and step, all their loads issued before
// the arithmetic (the Philox rounds of the dropout mask run while the loads are in flight):
// two for 16-bit types, one for float32 and float64, whose group is already two or four
// 16-byte loads, so every thread has at least 32 bytes of x in flight (more spilled).
// Register budget: kMinBlocksPerSm = 4 blocks of 256 threads (64 registers a thread). At 40
// (6 blocks) ptxas spilled the second group; 1024 threads x 32 bytes of x is 32 KiB of HBM
// loads in flight per SM, above the ~26 KiB Little's law asks at 4.3 TB/s, where one bf16
// group at 6 blocks gives 24 KiB.
template <typename T>
constexpr int kUnroll = sizeof(T) == 2 ? 2 : 1;
constexpr int kMinBlocksPerSm = 4;

template <typename scalar_t, typename table_t, typename index_t, bool kVectorized>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    add_position_forward_kernel(const scalar_t* __restrict__ x, const table_t* __restrict__ table,
                                scalar_t* __restrict__ out, index_t numel, RowMap<index_t> map,
                                CudaDropoutArgs dropout, int64_t* __restrict__ rng_out) {
  using acc_t = cuda::opmath_t<scalar_t>;
  uint64_t seed = 0, offset = 0;
  if (dropout.active) {
    const auto state = at::cuda::philox::unpack(dropout.philox);
    seed = std::get<0>(state);
    offset = std::get<1>(state);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      rng_out[0] = static_cast<int64_t>(seed);
      rng_out[1] = static_cast<int64_t>(offset);
    }
  }
  const acc_t scale = math::dropout_scale<acc_t>(dropout.keep_prob);
  const index_t groups = (numel + kGroup - 1) / kGroup;
  const index_t stride = static_cast<index_t>(gridDim.x) * kThreads;
  if constexpr (kVectorized) {
    for (index_t g0 = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; g0 < groups;
         g0 += stride * kUnroll<scalar_t>) {
      cuda::RawGroup<scalar_t> xs[kUnroll<scalar_t>];
      cuda::RawGroup<table_t> ts[kUnroll<scalar_t>];
#pragma unroll
      for (int u = 0; u < kUnroll<scalar_t>; ++u) {
        const index_t g = g0 + u * stride;
        if (g < groups) {
          const index_t e0 = g * kGroup;
          const auto rc = map.d.divmod(e0);
          const int64_t pos = map.position(rc.div);
          xs[u] = cuda::load_raw_group(x + e0);
          ts[u] = cuda::load_raw_group(table + pos * map.d.divisor + rc.mod);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll<scalar_t>; ++u) {
        const index_t g = g0 + u * stride;
        if (g >= groups) break;
        acc_t v[kGroup], t[kGroup], factors[kGroup];
        cuda::convert_group(xs[u], v);
        cuda::convert_group(ts[u], t);
        if (dropout.active) {
          dropout_factors<acc_t>(seed, offset, g, dropout.threshold, scale, factors);
        }
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          v[k] += t[k];
          if (dropout.active) v[k] *= factors[k];
        }
        store_group<scalar_t, acc_t>(out + g * kGroup, v);
      }
    }
  } else {
    for (index_t g = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; g < groups;
         g += stride) {
      acc_t factors[kGroup];
      if (dropout.active) {
        dropout_factors<acc_t>(seed, offset, g, dropout.threshold, scale, factors);
      }
      const index_t e0 = g * kGroup;
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        const index_t e = e0 + k;
        if (e >= numel) break;
        const auto rc = map.d.divmod(e);
        const int64_t pos = map.position(rc.div);
        acc_t v = static_cast<acc_t>(x[e]) + static_cast<acc_t>(table[pos * map.d.divisor + rc.mod]);
        if (dropout.active) v *= factors[k];
        out[e] = static_cast<scalar_t>(v);
      }
    }
  }
}

// The dropout backward: grad * mask * scale, the mask drawn again from (seed, offset).
// Same shape as the forward's fast path: kUnroll groups, loads before the Philox rounds.
template <typename scalar_t, typename index_t, bool kVectorized>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    add_position_backward_kernel(const scalar_t* __restrict__ grad, scalar_t* __restrict__ out,
                                 index_t numel, const int64_t* __restrict__ rng,
                                 uint32_t threshold, double keep_prob) {
  using acc_t = cuda::opmath_t<scalar_t>;
  const uint64_t seed = static_cast<uint64_t>(rng[0]);
  const uint64_t offset = static_cast<uint64_t>(rng[1]);
  const acc_t scale = math::dropout_scale<acc_t>(keep_prob);
  const index_t groups = (numel + kGroup - 1) / kGroup;
  const index_t stride = static_cast<index_t>(gridDim.x) * kThreads;
  for (index_t g0 = static_cast<index_t>(blockIdx.x) * kThreads + threadIdx.x; g0 < groups;
       g0 += stride * kUnroll<scalar_t>) {
    cuda::RawGroup<scalar_t> raw[kUnroll<scalar_t>];
    bool whole[kUnroll<scalar_t>];
#pragma unroll
    for (int u = 0; u < kUnroll<scalar_t>; ++u) {
      const index_t g = g0 + u * stride;
      whole[u] = kVectorized && g < groups && g * kGroup + kGroup <= numel;
      if (whole[u]) raw[u] = cuda::load_raw_group(grad + g * kGroup);
    }
#pragma unroll
    for (int u = 0; u < kUnroll<scalar_t>; ++u) {
      const index_t g = g0 + u * stride;
      if (g >= groups) break;
      acc_t factors[kGroup];
      dropout_factors<acc_t>(seed, offset, g, threshold, scale, factors);
      const index_t e0 = g * kGroup;
      if (whole[u]) {
        acc_t v[kGroup];
        cuda::convert_group(raw[u], v);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) v[k] *= factors[k];
        store_group<scalar_t, acc_t>(out + e0, v);
      } else {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          const index_t e = e0 + k;
          if (e >= numel) break;
          out[e] = static_cast<scalar_t>(static_cast<acc_t>(grad[e]) * factors[k]);
        }
      }
    }
  }
}

// One thread's running sums for 8 columns j0 .. j0+7 of the table gradient, over the rows
// it is given in a fixed order. add_row writes the row's masked gradient to grad_x (when
// wanted) and adds it to the sums. kAligned: d % 8 == 0 and 16-byte aligned pointers, so
// the 8 columns are one Philox block and two 16-byte accesses at most; otherwise element
// by element, one Philox call per dropout block touched.
template <typename scalar_t, bool kAligned>
struct ColumnGroupSum {
  using acc_t = cuda::opmath_t<scalar_t>;
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
        scale(math::dropout_scale<acc_t>(args.keep_prob)) {
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
                                       cuda::opmath_t<scalar_t>* __restrict__ sums,
                                       TableBackwardArgs args, int64_t tiles_per_row) {
  using acc_t = cuda::opmath_t<scalar_t>;
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
                                              cuda::opmath_t<scalar_t>* __restrict__ table,
                                              cuda::opmath_t<scalar_t>* __restrict__ start,
                                              cuda::opmath_t<scalar_t>* __restrict__ carry,
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

// One wave of resident blocks (the kernels are grid-stride; cuda::resident_blocks), or
// fewer when the tensor needs fewer, each thread given kUnroll groups a step.
template <typename scalar_t, typename Kernel>
cudaError_t grid_for(Kernel kernel, int64_t numel, unsigned* grid) {
  const int64_t groups = (numel + kGroup - 1) / kGroup;
  constexpr int64_t per_block = kThreads * kUnroll<scalar_t>;
  const int64_t wanted = (groups + per_block - 1) / per_block;
  int64_t wave = 0;
  POSENC_CUDA_TRY(cuda::resident_blocks(reinterpret_cast<const void*>(kernel), kThreads, &wave));
  *grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(wanted, wave)));
  return cudaSuccess;
}

// 32-bit indices when they fit: element indices are formed only for groups below `groups`
// (so below numel + kGroup), group indices stay below groups + kUnroll strides (a stride is
// at most one group per thread of the grid), far inside 32 bits.
bool fits_int32(int64_t numel) {
  return numel + kGroup * static_cast<int64_t>(kThreads) * 2 <
         std::numeric_limits<int32_t>::max();
}

template <typename scalar_t, typename table_t, typename index_t>
cudaError_t launch_forward(const AddPositionForwardLaunch& f, cudaStream_t stream) {
  const AddPositionArgs& g = f.g;
  RowMap<index_t> map{IntDivider<index_t>(static_cast<index_t>(g.d)),
                      IntDivider<index_t>(static_cast<index_t>(g.batch_first ? g.seq : g.batch)),
                      g.batch_first,
                      f.positions,
                      g.positions_batch_stride,
                      g.offset,
                      g.table_len};
  const bool vectorized = g.d % kGroup == 0 && is_aligned16(f.x) && is_aligned16(f.out) && is_aligned16(f.table);
  auto kernel = vectorized ? add_position_forward_kernel<scalar_t, table_t, index_t, true>
                           : add_position_forward_kernel<scalar_t, table_t, index_t, false>;
  unsigned grid = 0;
  POSENC_CUDA_TRY(grid_for<scalar_t>(kernel, f.numel, &grid));
  kernel<<<grid, kThreads, 0, stream>>>(static_cast<const scalar_t*>(f.x), static_cast<const table_t*>(f.table),
                                        static_cast<scalar_t*>(f.out), static_cast<index_t>(f.numel), map,
                                        f.dropout, f.rng_out);
  return cudaGetLastError();
}

}  // namespace

template <typename scalar_t>
cudaError_t launch_add_position_forward(const AddPositionForwardLaunch& f, cudaStream_t stream) {
  if (f.numel == 0) return cudaSuccess;
  using wide_t = cuda::opmath_t<scalar_t>;
  if (fits_int32(f.numel)) {
    return f.table_same_dtype ? launch_forward<scalar_t, scalar_t, uint32_t>(f, stream)
                              : launch_forward<scalar_t, wide_t, uint32_t>(f, stream);
  }
  return f.table_same_dtype ? launch_forward<scalar_t, scalar_t, uint64_t>(f, stream)
                            : launch_forward<scalar_t, wide_t, uint64_t>(f, stream);
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_add_position_forward, const AddPositionForwardLaunch&, cudaStream_t)

template <typename scalar_t>
cudaError_t launch_add_position_backward(const void* grad, void* out, int64_t numel, const int64_t* rng,
                                         uint32_t threshold, double keep_prob, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const bool vectorized = is_aligned16(grad) && is_aligned16(out);
  auto launch = [&](auto index_zero) -> cudaError_t {
    using index_t = decltype(index_zero);
    auto kernel = vectorized ? add_position_backward_kernel<scalar_t, index_t, true>
                             : add_position_backward_kernel<scalar_t, index_t, false>;
    unsigned grid = 0;
    POSENC_CUDA_TRY(grid_for<scalar_t>(kernel, numel, &grid));
    kernel<<<grid, kThreads, 0, stream>>>(static_cast<const scalar_t*>(grad), static_cast<scalar_t*>(out),
                                          static_cast<index_t>(numel), rng, threshold, keep_prob);
    return cudaGetLastError();
  };
  return fits_int32(numel) ? launch(uint32_t{0}) : launch(uint64_t{0});
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_add_position_backward, const void*, void*, int64_t, const int64_t*, uint32_t,
                                 double, cudaStream_t)

template <typename scalar_t>
cudaError_t launch_add_position_backward_table(const TableBackwardArgs& args, const void* grad, void* grad_x,
                                               void* sums, cudaStream_t stream) {
  using acc_t = cuda::opmath_t<scalar_t>;
  const int64_t groups_per_row = (args.d + kGroup - 1) / kGroup;
  const bool aligned = args.d % kGroup == 0 && is_aligned16(grad) && (grad_x == nullptr || is_aligned16(grad_x));
  auto kernel = aligned ? add_position_backward_table_kernel<scalar_t, true>
                        : add_position_backward_table_kernel<scalar_t, false>;
  // Tile width: the row's column groups, up to a warp's 32 (a warp then reads 512
  // contiguous bytes of bf16 rows); the rest of the 256 threads split the batch.
  const TableTiles tiles = table_tiles(groups_per_row, kThreads);
  const dim3 block(tiles.width, tiles.slices);
  kernel<<<args.seq * tiles.tiles_per_row, block, 0, stream>>>(static_cast<const scalar_t*>(grad),
                                                               static_cast<scalar_t*>(grad_x),
                                                               static_cast<acc_t*>(sums), args, tiles.tiles_per_row);
  return cudaGetLastError();
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_add_position_backward_table, const TableBackwardArgs&, const void*, void*,
                                 void*, cudaStream_t)

template <typename scalar_t>
cudaError_t launch_add_position_backward_table_sorted(const TableBackwardArgs& args, const void* grad, void* grad_x,
                                                      void* table, void* start, void* carry, const SortedRuns& runs,
                                                      const int64_t* rows, int64_t table_len, cudaStream_t stream) {
  using acc_t = cuda::opmath_t<scalar_t>;
  const int64_t groups_per_row = (args.d + kGroup - 1) / kGroup;
  const bool aligned = args.d % kGroup == 0 && is_aligned16(grad) && (grad_x == nullptr || is_aligned16(grad_x));
  const int64_t threads = args.batch * args.seq * groups_per_row;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  auto kernel = aligned ? add_position_backward_table_sorted_kernel<scalar_t, true>
                        : add_position_backward_table_sorted_kernel<scalar_t, false>;
  kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const scalar_t*>(grad), static_cast<scalar_t*>(grad_x),
                                          static_cast<acc_t*>(table), static_cast<acc_t*>(start),
                                          static_cast<acc_t*>(carry), runs, rows, table_len, args);
  POSENC_CUDA_TRY(cudaGetLastError());
  const int64_t run_threads = runs.chunks() * groups_per_row;
  add_position_backward_table_runs_kernel<acc_t><<<(run_threads + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      static_cast<acc_t*>(table), static_cast<const acc_t*>(start), static_cast<const acc_t*>(carry), runs,
      table_len, args.d);
  return cudaGetLastError();
}
POSENC_CUDA_INSTANTIATE_FLOATING(launch_add_position_backward_table_sorted, const TableBackwardArgs&, const void*,
                                 void*, void*, void*, void*, const SortedRuns&, const int64_t*, int64_t, cudaStream_t)

}  // namespace ops
}  // namespace posenc
