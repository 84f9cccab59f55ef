// The add_position family's CUDA launchers (add_position.cu), called by add_position.cpp's
// CUDA registration: plain kernel arguments in, the launch's cudaError_t out
// (cuda/common/occupancy.cuh), on the current device, for float, double, c10::Half and
// c10::BFloat16 (scalar_t: x's and grad's dtype; the table gradient is in the compute dtype,
// float32, or float64 for float64). Pointers are to contiguous tensors.
#pragma once

#include <ATen/cuda/PhiloxCudaState.h>  // at::PhiloxCudaState (plain data)
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/add_position/cpu/kernel.h"  // AddPositionArgs
#include "ops/common/sorted_runs.h"      // SortedRuns

namespace posenc {
namespace ops {

// The dropout of a forward: the generator's state, unpacked in the kernel (CUDA graphs), and
// the keep threshold and scale of math::make_dropout_params.
struct CudaDropoutArgs {
  at::PhiloxCudaState philox;
  uint32_t threshold;
  double keep_prob;  // 1 - p: survivors scaled by math::dropout_scale of it
  bool active;
};

// add_position_forward: out = dropout(x + table[position]) over numel elements of rows of g.d.
struct AddPositionForwardLaunch {
  AddPositionArgs g;
  const void* x = nullptr;
  const void* table = nullptr;         // (table_len, d)
  bool table_same_dtype = true;        // false: the table is in x's compute dtype
  const int64_t* positions = nullptr;  // null: position = offset + s
  void* out = nullptr;
  int64_t numel = 0;
  CudaDropoutArgs dropout{};
  int64_t* rng_out = nullptr;  // (seed, offset), written when dropout.active
};
template <typename scalar_t>
cudaError_t launch_add_position_forward(const AddPositionForwardLaunch& f, cudaStream_t stream);

// add_position_backward: out = grad * mask * scale, the mask drawn again from rng (seed, offset).
template <typename scalar_t>
cudaError_t launch_add_position_backward(const void* grad, void* out, int64_t numel, const int64_t* rng,
                                         uint32_t threshold, double keep_prob, cudaStream_t stream);

// add_position_backward_with_table: grad_x (null: not wanted) and the table gradient.
struct TableBackwardArgs {
  int64_t batch, seq, d;
  bool batch_first;
  const int64_t* rng;  // (seed, offset) on the device; null when p == 0
  uint32_t threshold;
  double keep_prob;  // 1 - p: survivors scaled by math::dropout_scale of it
};
// Positions that depend on s only: the (seq, d) sums over the batch, per s, into `sums`.
template <typename scalar_t>
cudaError_t launch_add_position_backward_table(const TableBackwardArgs& args, const void* grad, void* grad_x,
                                               void* sums, cudaStream_t stream);
// (batch, seq) positions: rows (the memory rows sorted stably by their table row, whose keys
// `runs` holds; table_len marks a row outside the table) summed into the zeroed `table`,
// with start and carry (runs.chunks() x d) the partials of runs that cross chunks.
template <typename scalar_t>
cudaError_t launch_add_position_backward_table_sorted(const TableBackwardArgs& args, const void* grad, void* grad_x,
                                                      void* table, void* start, void* carry, const SortedRuns& runs,
                                                      const int64_t* rows, int64_t table_len, cudaStream_t stream);

}  // namespace ops
}  // namespace posenc
