// The posenc operator schemas: the single definition of every op, reached from Python as
// torch.ops.posenc.* and from C++ through the functions in posenc/ops.h.
//
//   add_position           public op: dropout(x + table[positions]); autograd in C++.
//   add_position_forward   its forward kernel; also returns the dropout (seed, offset).
//   add_position_backward  grad * mask * scale, the mask regenerated from (seed, offset),
//                          so the autograd graph stores no mask.
//   add_position_backward_with_table
//                          fused backward for x and the table: grad read once, the
//                          table gradient summed deterministically over the batch.
//   sinusoidal_table       the fixed encoding evaluated at arbitrary positions.
//   rope                   rotary position embedding of q (and k), out of place; its
//                          backward is the same op with inverse=True.
//   rope_                  the same rotation in place (inference).
//   rope_frequencies       inverse frequencies and attention factor of a configuration.
//   rope_position_bounds   (smallest, largest) position a rope call rotates ((0, -1): none);
//                          reads index tensors back to the host.
#include <ATen/core/enum_tag.h>
#include <torch/library.h>

TORCH_LIBRARY(posenc, m) {
  m.def(
      "add_position(Tensor x, Tensor table, Tensor? positions=None, SymInt offset=0, "
      "bool batch_first=True, float p=0.0) -> Tensor",
      {at::Tag::nondeterministic_seeded});
  m.def(
      "add_position_forward(Tensor x, Tensor table, Tensor? positions, SymInt offset, "
      "bool batch_first, float p) -> (Tensor, Tensor)",
      {at::Tag::nondeterministic_seeded});
  m.def("add_position_backward(Tensor grad, Tensor rng, float p) -> Tensor");
  // Returns (grad_x, grad_table): grad_x is empty unless need_x; grad_table is
  // (table_len, d) in float32 (float64 for float64 grad).
  m.def(
      "add_position_backward_with_table(Tensor grad, Tensor rng, Tensor? positions, "
      "SymInt offset, bool batch_first, float p, SymInt table_len, bool need_x) "
      "-> (Tensor, Tensor)");
  m.def(
      "sinusoidal_table(Tensor positions, SymInt d_model, float base=10000.0, "
      "ScalarType? dtype=None) -> Tensor");
  // RoPE. rope_type and scaling carry Hugging Face's rope_scaling dict: scaling lists
  // (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, beta_fast,
  // beta_slow, attention_factor, mscale, mscale_all_dim, truncate), NaN where not given.
  // seq_len (longest position + 1) matters for "dynamic" only; -1 derives it from the call
  // (a device sync when positions, offsets or cu_seqlens are CUDA tensors). rotary_dim=-1:
  // head_dim.
  // Returns (q rotated, k rotated or an empty tensor when k is None).
  m.def(
      "rope(Tensor q, Tensor? k=None, Tensor? positions=None, Tensor? offsets=None, "
      "SymInt offset=0, Tensor? cu_seqlens=None, float base=10000.0, str rope_type=\"default\", "
      "float[] scaling=[], int seq_len=0, int rotary_dim=-1, bool interleaved=False, "
      "str layout=\"bshd\", bool inverse=False) -> (Tensor, Tensor)");
  m.def(
      "rope_(Tensor(a!) q, Tensor(b!)? k=None, Tensor? positions=None, Tensor? offsets=None, "
      "SymInt offset=0, Tensor? cu_seqlens=None, float base=10000.0, str rope_type=\"default\", "
      "float[] scaling=[], int seq_len=0, int rotary_dim=-1, bool interleaved=False, "
      "str layout=\"bshd\", bool inverse=False) -> ()");
  m.def(
      "rope_frequencies(int rotary_dim, float base=10000.0, str rope_type=\"default\", "
      "float[] scaling=[], int seq_len=0) -> (Tensor, float)");
  m.def(
      "rope_position_bounds(Tensor q, Tensor? positions=None, Tensor? offsets=None, "
      "int offset=0, Tensor? cu_seqlens=None, str layout=\"bshd\") -> (int, int)");
}
