// Argument validation for the add_position ops, shared by the CPU, CUDA and Meta
// kernels so that every backend rejects the same inputs with the same message.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "ops/add_position/add_position_args.h"

namespace posenc {
namespace ops {

// ValueError unless p is in [0, 1] (a NaN or negative p would reach an unsigned cast).
void check_dropout_probability(double p);

// rng, the dropout state a forward returned: the int64 (seed, offset) pair on grad's device,
// or, on the CPU only, the uint8 keep mask of save_mask=True, of shape
// (grad.size(0), grad.size(1), ceil(grad.size(2) / 8)).
void check_dropout_state(const at::Tensor& grad, const at::Tensor& rng);

// The arguments of add_position_backward on every backend: rng (check_dropout_state; the
// kernels read it whatever p), p, grad's dtype.
void check_dropout_backward_args(const at::Tensor& grad, const at::Tensor& rng, double p);

// Checks shapes, dtypes, devices and p; works on Meta tensors (no data access, symbolic
// sizes). The real kernels get the geometry from check_add_position_inputs.
void check_add_position_structure(const at::Tensor& x, const at::Tensor& table,
                                  const std::optional<at::Tensor>& positions,
                                  bool batch_first, double p);

// Full checks for a real kernel: structure, then the offset/sequence range. Position
// values are checked by the caller where reading them costs no device sync.
AddPositionArgs check_add_position_inputs(const at::Tensor& x, const at::Tensor& table,
                                              const std::optional<at::Tensor>& positions,
                                              int64_t offset, bool batch_first, double p);

// Checks of the fused backward (grad, rng, positions, offset, table_len), as in the forward.
AddPositionArgs check_add_position_backward_inputs(const at::Tensor& grad,
                                                       const at::Tensor& rng,
                                                       const std::optional<at::Tensor>& positions,
                                                       int64_t offset, bool batch_first, double p,
                                                       int64_t table_len);

// The same, when offset, table_len and grad's sizes are concrete (the composite and Meta
// kernels; symbolic sizes only trace, and the real kernels check at run time).
void check_add_position_backward_inputs_if_concrete(const at::Tensor& grad, const at::Tensor& rng,
                                                     const std::optional<at::Tensor>& positions,
                                                     const c10::SymInt& offset, bool batch_first,
                                                     double p, const c10::SymInt& table_len);

// Throws IndexError naming the first position outside [0, table_len). CPU tensors only.
void check_positions_in_range_cpu(const at::Tensor& positions, int64_t table_len);

// The table as a contiguous (max_len, d) matrix whose dtype the kernels accept: x's
// own dtype or float32 (float64 for float64 x); any other dtype is converted.
at::Tensor table_as_matrix(const at::Tensor& table, at::ScalarType x_dtype);

// The table ops compute and return float64; the front ends (posenc::sinusoidal_table,
// posenc.functional.sinusoidal_table) round it once to the dtype asked for with an ATen cast,
// so no ScalarType argument has to travel through an exported graph (torch 2.11's AOTInductor
// proxy executor misread them: a table came back as None).
void check_sinusoidal_table_args(const at::Tensor& positions, int64_t d_model, double base);

}  // namespace ops
}  // namespace posenc
