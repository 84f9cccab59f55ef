// The posenc operator schemas: the single definition of every op, reached from Python as
// torch.ops.posenc.* and from C++ through the functions in posenc/ops.h.
//
//   add_position           public op: dropout(x + table[positions]); autograd in C++.
//   add_position_forward   its forward kernel; also returns rng, the dropout state: the
//                          (seed, offset) key, or with save_mask=True (CPU only; autograd
//                          sets it for CPU training) the keep mask, 1 bit per element.
//   add_position_backward  grad * mask * scale, the mask regenerated from (seed, offset)
//                          (so on CUDA the autograd graph stores no mask) or read from the
//                          saved bits.
//   add_position_backward_with_table
//                          fused backward for x and the table: grad read once, the
//                          table gradient summed deterministically over the batch.
//   sinusoidal_table       the fixed encoding evaluated at arbitrary positions.
//
// The RoPE ops (rope, rope_, rope_position_bounds, rope_frequencies, rope_scaling_spec) are
// defined beside the one reader of their arguments, in rope/rope_call.cpp.
// The helpers (make_positions, sinusoidal_2d_table, resample_position_table,
// timestep_embedding: helpers/*.cpp) and position_bounds (position_bounds.cpp) are each
// defined in their own file, beside their one kernel.
#include <ATen/core/enum_tag.h>
#include <torch/library.h>

TORCH_LIBRARY(posenc, m) {
  m.def(
      "add_position(Tensor x, Tensor table, Tensor? positions=None, SymInt offset=0, "
      "bool batch_first=True, float p=0.0) -> Tensor",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "add_position_forward(Tensor x, Tensor table, Tensor? positions, SymInt offset, "
      "bool batch_first, float p, bool save_mask=False) -> (Tensor, Tensor)",
      {at::Tag::nondeterministic_seeded});
  m.def("add_position_backward(Tensor grad, Tensor rng, float p) -> Tensor");
  // Returns (grad_x, grad_table): grad_x is empty unless need_x; grad_table is
  // (table_len, d) in float32 (float64 for float64 grad).
  m.def(
      "add_position_backward_with_table(Tensor grad, Tensor rng, Tensor? positions, "
      "SymInt offset, bool batch_first, float p, SymInt table_len, bool need_x) "
      "-> (Tensor, Tensor)");
  m.def(
      "sinusoidal_table(Tensor positions, SymInt d_model, float base=10000.0) -> Tensor");
}
