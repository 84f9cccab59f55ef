// The add_position family's ops: their schemas, argument checks, the position bounds ops,
// the Meta kernels, the kernels composed of ATen ops and the CPU and CUDA backends (the CUDA
// one's host side: its kernels are in cuda/add_position/add_position.cu). Autograd is in
// autograd.cpp, the vectorised CPU kernels in cpu/kernel.cpp.
//
// The CPU backend: argument checks, the dropout draw from the default CPU generator, and the
// call of the vectorised kernels in cpu/kernel.cpp (built once per vector ISA, chosen at run
// time: cpu_capability.h). save_mask (set by autograd for CPU training): the forward returns
// the keep mask, one bit per element (cpu::DropoutArgs), in place of the (seed, offset) key,
// and the backward ops read it instead of regenerating it. Reading 1 bit per element is
// cheaper on a CPU than running Philox again (its 10 rounds cost more than the bits' read); CUDA keeps regenerating
// (its Philox is free beside the memory traffic), so no tensor of x's size is saved there.
#include "ops/add_position/add_position.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/enum_tag.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <initializer_list>
#include <optional>
#include <tuple>

#include "ops/add_position/cpu/kernel.h"
#include "ops/common/aten_fallback.h"
#include "ops/common/cpu/cpu_support.h"
#include "ops/common/float_types.h"
#include "ops/common/meta_support.h"
#include "ops/common/op_handles.h"
#include "ops/common/position_range.h"
#include "ops/common/py_format.h"
#include "posenc/math/philox.h"

namespace posenc {
namespace ops {

// ---- Schemas.
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
//   position_bounds, position_range_check, position_run_check: the modules' range check of positions (below).
TORCH_LIBRARY_FRAGMENT(posenc, m) {
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
  // (table_len, d), summed in float32 (float64 for float64 grad) and returned in table_dtype
  // (None: that float32/float64 sum), rounded once. Autograd asks for the table's dtype:
  // without positions and with the table in grad's dtype, the CPU kernel writes the touched
  // rows in that dtype from its sums (no float32 table zero-filled and converted afterwards).
  m.def(
      "add_position_backward_with_table(Tensor grad, Tensor rng, Tensor? positions, "
      "SymInt offset, bool batch_first, float p, SymInt table_len, bool need_x, "
      "ScalarType? table_dtype=None) -> (Tensor, Tensor)");
}

// ---- Argument checks, shared by the CPU, CUDA and Meta kernels so that every backend
// rejects the same inputs with the same message.

namespace {

const char* layout_name(bool batch_first) {
  return batch_first ? "(batch, seq, d_model) with batch_first=True"
                     : "(seq, batch, d_model) with batch_first=False";
}

// TypeError naming grad unless it has a dtype the kernels take.
void check_grad_dtype(const at::Tensor& grad) {
  TORCH_CHECK_TYPE(is_supported_float(grad.scalar_type()),
                   "posenc: expected grad to have a floating-point dtype (float16, bfloat16, "
                   "float32 or float64), got ", grad.scalar_type());
}

// ValueError unless p is in [0, 1] (a NaN or negative p would reach an unsigned cast).
void check_dropout_probability(double p) {
  TORCH_CHECK_VALUE(std::isfinite(p) && p >= 0.0 && p <= 1.0,
                    "posenc: expected dropout probability p in [0, 1], got ", p);
}

// rng, the dropout state a forward returned: the int64 (seed, offset) pair on grad's device,
// or, on the CPU only, the uint8 keep mask of save_mask=True, of shape
// (grad.size(0), grad.size(1), ceil(grad.size(2) / 8)).
void check_dropout_state(const at::Tensor& grad, const at::Tensor& rng) {
  // sym_*: the Meta kernels run this too, where rng can have symbolic sizes.
  if (rng.scalar_type() == at::kByte) {
    TORCH_CHECK(grad.device().is_cpu() || grad.device().is_meta(),
                "posenc: a saved dropout mask (uint8 rng, add_position_forward with "
                "save_mask=True) is CPU-only; on ", grad.device(),
                " rng must be the int64 (seed, offset) pair");
    const bool ok = rng.device() == grad.device() && grad.dim() == 3 && rng.dim() == 3 &&
                    rng.sym_size(0) == grad.sym_size(0) && rng.sym_size(1) == grad.sym_size(1) &&
                    rng.sym_size(2) == (grad.sym_size(2) + 7) / 8;
    TORCH_CHECK(ok, "posenc: expected rng, the saved dropout mask (uint8), to have shape "
                "(grad.size(0), grad.size(1), ceil(grad.size(2) / 8)) on ", grad.device(),
                " for grad of shape ", grad.sym_sizes(), ", got shape ", rng.sym_sizes(), " on ",
                rng.device());
    return;
  }
  TORCH_CHECK(rng.device() == grad.device() && rng.sym_numel() == 2 &&
                  rng.scalar_type() == at::kLong,
              "posenc: expected rng to be the int64 (seed, offset) pair from the forward on ",
              grad.device(), ", got ", rng.scalar_type(), " of shape ", rng.sym_sizes(), " on ",
              rng.device());
}

// Checks shapes, dtypes, devices and p; works on Meta tensors (no data access, symbolic
// sizes). The real kernels get the geometry from check_add_position_inputs.
void check_add_position_structure(const at::Tensor& x, const at::Tensor& table,
                                  const std::optional<at::Tensor>& positions,
                                  bool batch_first, double p) {
  TORCH_CHECK(x.dim() == 3, "posenc: expected x to be a 3-D tensor ", layout_name(batch_first),
              ", got a ", x.dim(), "-D tensor of shape ", x.sym_sizes());
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()),
                   "posenc: expected x to have a floating-point dtype (float16, bfloat16, "
                   "float32 or float64), got ",
                   x.scalar_type());
  TORCH_CHECK(table.dim() == 2 || (table.dim() == 3 && table.sym_size(0) == 1),
              "posenc: expected the position table to have shape (max_len, d_model) or "
              "(1, max_len, d_model), got shape ",
              table.sym_sizes());
  TORCH_CHECK_TYPE(is_supported_float(table.scalar_type()),
                   "posenc: expected the position table to have a floating-point dtype, got ",
                   table.scalar_type());
  TORCH_CHECK(x.device() == table.device(), "posenc: expected x and the position table on the ",
              "same device, got x on ", x.device(), " and the table on ", table.device(),
              " (move the module with .to(x.device))");
  TORCH_CHECK(x.sym_size(2) == table.sym_size(-1), "posenc: expected the last dimension of x ",
              "(d_model) to be ", table.sym_size(-1), " like the position table, got x of shape ",
              x.sym_sizes());
  check_dropout_probability(p);
  if (positions.has_value()) {
    const at::Tensor& pos = *positions;
    TORCH_CHECK_TYPE(pos.scalar_type() == at::kLong,
                     "posenc: expected positions to have dtype torch.int64, got ",
                     pos.scalar_type());
    TORCH_CHECK(pos.device() == x.device(), "posenc: expected positions on x's device ",
                x.device(), ", got positions on ", pos.device());
    const auto batch = x.sym_size(batch_first ? 0 : 1);
    const auto seq = x.sym_size(batch_first ? 1 : 0);
    // (1, seq): Hugging Face's position_ids of one sequence, shared by the batch rows (as
    // the RoPE ops take them).
    const bool ok = (pos.dim() == 1 && pos.sym_size(0) == seq) ||
                    (pos.dim() == 2 && (pos.sym_size(0) == batch || pos.sym_size(0) == 1) &&
                     pos.sym_size(1) == seq);
    TORCH_CHECK(ok, "posenc: expected positions of shape (seq,) = (", seq, ",) or (batch, seq) = (",
                batch, ", ", seq, "), got shape ", pos.sym_sizes(), " ((1, seq) serves every row)");
  }
}

// Sizes, positions layout and the offset range, once the structure has been checked.
AddPositionArgs make_geometry(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                              int64_t offset, bool batch_first, int64_t table_len) {
  AddPositionArgs g;
  g.batch_first = batch_first;
  g.batch = x.size(batch_first ? 0 : 1);
  g.seq = x.size(batch_first ? 1 : 0);
  g.d = x.size(2);
  g.table_len = table_len;
  g.offset = offset;
  if (positions.has_value()) {
    TORCH_CHECK_VALUE(offset == 0, "posenc: pass either offset or positions, not both (got offset=",
                      offset, " with positions)");
    g.has_positions = true;
    // 0: one row of positions for every batch row ((seq,) or (1, seq)).
    g.positions_batch_stride = positions->dim() == 2 && positions->size(0) != 1 ? g.seq : 0;
  } else {
    TORCH_CHECK_VALUE(offset >= 0, "posenc: expected offset >= 0, got ", offset);
    // offset <= len - seq, not offset + seq <= len: a huge offset must not wrap around.
    TORCH_CHECK_VALUE(offset <= g.table_len - g.seq, "posenc: sequence length ", g.seq,
                      " plus offset ", offset, " exceeds max_len=", g.table_len,
                      " of the position table (build the encoding with a larger max_len)");
  }
  return g;
}

// Throws IndexError naming the first position outside [0, table_len). CPU tensors only.
// Returns the smallest and largest position ({0, -1} for none).
std::pair<int64_t, int64_t> check_positions_in_range_cpu(const at::Tensor& positions, int64_t table_len) {
  const at::Tensor pos = positions.contiguous();
  const int64_t* data = pos.const_data_ptr<int64_t>();
  const int64_t n = pos.numel();
  int64_t lo = n > 0 ? table_len : 0, hi = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (data[i] < 0 || data[i] >= table_len) {
      throw_position_out_of_range(table_len, data[i], c10::str(" at flat index ", i));
    }
    lo = std::min(lo, data[i]);
    hi = std::max(hi, data[i]);
  }
  return {lo, hi};
}

// True when the positions are one strictly increasing row: (S,) positions, or (B, S) ones
// whose rows are all the same (Hugging Face's expanded position_ids, arange(S) + start). Then
// every s has its own table row, and the backward sums each row over the batch (b ascending,
// as the walk over (B, S) rows adds them) and writes it once, with s split over threads: the
// same bits, 2-3x faster than adding row by row into the table.
bool positions_distinct(const at::Tensor& pos) {
  const int64_t seq = pos.size(-1), rows = pos.numel() / std::max<int64_t>(seq, 1);
  const int64_t* data = pos.const_data_ptr<int64_t>();
  for (int64_t s = 1; s < seq; ++s) {
    if (data[s] <= data[s - 1]) return false;
  }
  for (int64_t b = 1; b < rows; ++b) {
    if (!std::equal(data, data + seq, data + b * seq)) return false;
  }
  return true;
}

}  // namespace

void check_dropout_backward_args(const at::Tensor& grad, const at::Tensor& rng, double p) {
  check_dropout_state(grad, rng);
  check_dropout_probability(p);
  check_grad_dtype(grad);
}

AddPositionArgs check_add_position_inputs(const at::Tensor& x, const at::Tensor& table,
                                          const std::optional<at::Tensor>& positions,
                                          int64_t offset, bool batch_first, double p) {
  check_add_position_structure(x, table, positions, batch_first, p);
  return make_geometry(x, positions, offset, batch_first, table.size(-2));
}

AddPositionArgs check_add_position_backward_inputs(const at::Tensor& grad, const at::Tensor& rng,
                                                   const std::optional<at::Tensor>& positions,
                                                   int64_t offset, bool batch_first, double p,
                                                   int64_t table_len) {
  TORCH_CHECK_VALUE(table_len >= 0, "posenc: expected table_len >= 0, got ", table_len);
  TORCH_CHECK(grad.dim() == 3, "posenc: expected grad to be a 3-D tensor, got shape ",
              grad.sizes());
  check_grad_dtype(grad);
  TORCH_CHECK_VALUE(table_len <= std::numeric_limits<int64_t>::max() / std::max<int64_t>(grad.size(2), 1),
                    "posenc: table_len ", table_len, " times d_model ", grad.size(2),
                    " overflows int64");
  // The structure checks of the forward, against a stand-in table on grad's device
  // (zero strides: it allocates one element, not a table).
  const at::Tensor table = at::empty_strided({table_len, grad.size(2)}, {0, 0}, grad.options());
  check_add_position_structure(grad, table, positions, batch_first, p);
  if (p > 0.0) check_dropout_state(grad, rng);
  return make_geometry(grad, positions, offset, batch_first, table_len);
}

namespace {

// The dtype the backends accumulate in: float64 for float64, else float32.
at::ScalarType accumulate_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A (table_len, d) table gradient whose rows outside first .. first + count - 1 are zeros;
// those rows are left for the caller to write (the only rows any gradient reached).
at::Tensor table_zeroed_outside(int64_t table_len, int64_t d, int64_t first, int64_t count,
                                const at::TensorOptions& options) {
  at::Tensor table = at::empty({table_len, d}, options);
  table.narrow(0, 0, first).zero_();
  table.narrow(0, first + count, table_len - first - count).zero_();
  return table;
}

// The dtype of the table gradient: table_dtype, or the accumulation dtype when None.
at::ScalarType table_gradient_dtype(const at::Tensor& grad, std::optional<at::ScalarType> table_dtype) {
  const at::ScalarType acc = accumulate_dtype(grad);
  TORCH_CHECK_TYPE(!table_dtype.has_value() || is_supported_float(*table_dtype),
                   "posenc: add_position_backward_with_table: expected table_dtype to be float32, float64, "
                   "float16 or bfloat16, got ", table_dtype.value_or(acc));
  return table_dtype.value_or(acc);
}

// The offset as an int when it and the sizes of the tensors are concrete (the composite and
// Meta kernels: a meta dry run, FakeTensor tracing of concrete sizes), for the real kernels'
// checks; none when any is symbolic (it only traces; the kernels check at run time).
std::optional<int64_t> concrete_offset(const c10::SymInt& offset,
                                       std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t != nullptr && t->defined() && t->unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return std::nullopt;
  }
  // maybe_as_int, not is_heap_allocated: a SymInt stores ints near -2**63 on the heap too.
  return offset.maybe_as_int();
}

// The backward's checks when offset, table_len and the sizes are concrete (concrete_offset).
void check_add_position_backward_inputs_if_concrete(const at::Tensor& grad, const at::Tensor& rng,
                                                     const std::optional<at::Tensor>& positions,
                                                     const c10::SymInt& offset, bool batch_first,
                                                     double p, const c10::SymInt& table_len) {
  const std::optional<int64_t> off = concrete_offset(offset, {&grad, optional_ptr(positions)});
  const std::optional<int64_t> len = table_len.maybe_as_int();
  if (off.has_value() && len.has_value()) {
    check_add_position_backward_inputs(grad, rng, positions, *off, batch_first, p, *len);
  }
}

}  // namespace

at::Tensor table_as_matrix(const at::Tensor& table, at::ScalarType x_dtype) {
  at::Tensor t = table.dim() == 3 ? table.select(0, 0) : table;
  const at::ScalarType wide = x_dtype == at::kDouble ? at::kDouble : at::kFloat;
  if (t.scalar_type() != x_dtype && t.scalar_type() != wide) {
    t = t.to(wide);
  }
  return t.contiguous();
}

// ---- posenc::position_bounds: the smallest and largest value of an add_position positions
// tensor, computed on its device and read back once (one device sync on CUDA), and, given
// max_len, the range check of the add-position modules (Python and C++): IndexError unless
// every position lies in [0, max_len). The modules call it for CUDA positions in eager mode
// (CPU positions are checked inside the kernel, where reading them costs nothing). The
// message and the check from (min, max) are shared with the RoPE modules
// (ops/common/position_range.h).

namespace {

void position_range_check(int64_t lo, int64_t hi, int64_t max_len) {
  check_position_range(lo, hi, max_len);
}

void position_run_check(int64_t first, int64_t count, int64_t max_len) {
  check_position_run(first, count, max_len);
}

std::tuple<int64_t, int64_t> position_bounds(const at::Tensor& positions,
                                             std::optional<int64_t> max_len) {
  TORCH_CHECK_TYPE(!positions.is_floating_point() && !positions.is_complex() &&
                       positions.scalar_type() != at::kBool,
                   "position_bounds: expected integer positions, got ",
                   py_dtype(positions.scalar_type()));
  if (max_len.has_value()) {
    TORCH_CHECK_VALUE(*max_len >= 0, "position_bounds: expected max_len >= 0, got ", *max_len);
  }
  if (positions.numel() == 0) return {0, -1};  // no position, nothing read back
  TORCH_CHECK(!positions.is_meta(), "position_bounds: reads the positions' values: expected positions that hold "
              "data, got a tensor on the meta device");
  auto [lo, hi] = at::aminmax(positions.to(at::kLong));
  const at::Tensor both = at::stack({lo, hi}).to(at::kCPU);  // the one read-back
  const int64_t* v = both.const_data_ptr<int64_t>();
  if (max_len.has_value()) check_position_range(v[0], v[1], *max_len);
  return {v[0], v[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // (min, max) of positions, (0, -1) when empty; with max_len, IndexError unless all lie
  // in [0, max_len). Reads values, so it has no Meta form: the modules skip it under
  // torch.compile.
  m.def("position_bounds(Tensor positions, int? max_len=None) -> (int, int)");
  // The same range check from (min, max) already known (the RoPE modules'); no tensor, so
  // one kernel for every backend.
  m.def("position_range_check(int lo, int hi, int max_len) -> ()", &position_range_check);
  // The same for positions first .. first + count - 1 (an offset and a length), whose end
  // may lie past int64.
  m.def("position_run_check(int first, int count, int max_len) -> ()", &position_run_check);
}

// Composed of ATen ops, so one kernel serves every backend.
TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("position_bounds", &position_bounds);
}

// ---- Meta kernels of add_position_forward, add_position_backward and
// add_position_backward_with_table: shapes and dtypes only, with symbolic sizes, so
// torch.compile and torch.export trace them without running them or breaking the graph.

namespace {

std::tuple<at::Tensor, at::Tensor> add_position_forward_meta(
    const at::Tensor& x, const at::Tensor& table, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, bool batch_first, double p, bool save_mask) {
  check_add_position_structure(x, table, positions, batch_first, p);
  check_not_mixed_with_meta("add_position_forward",
                            {{"x", &x}, {"table", &table}, {"positions", optional_ptr(positions)}});
  // The offset against the table as the real kernels check it, when concrete.
  if (const std::optional<int64_t> off = concrete_offset(offset, {&x, &table, optional_ptr(positions)})) {
    make_geometry(x, positions, *off, batch_first, table.size(-2));
  }
  at::Tensor out = at::empty_symint(x.sym_sizes(), x.options());
  if (save_mask && p > 0.0) {
    // The keep mask, 1 bit per element, rows padded to whole bytes (the CPU kernel's layout).
    at::Tensor mask = at::empty_symint({x.sym_size(0), x.sym_size(1), (x.sym_size(2) + 7) / 8},
                                       x.options().dtype(at::kByte));
    return {out, mask};
  }
  at::Tensor rng = at::empty({p > 0.0 ? 2 : 0}, x.options().dtype(at::kLong));
  return {out, rng};
}

at::Tensor add_position_backward_meta(const at::Tensor& grad, const at::Tensor& rng, double p) {
  check_not_mixed_with_meta("add_position_backward", {{"grad", &grad}, {"rng", &rng}});
  check_dropout_backward_args(grad, rng, p);
  return at::empty_symint(grad.sym_sizes(), grad.options());
}

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_meta(
    const at::Tensor& grad, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, bool batch_first, double p, c10::SymInt table_len, bool need_x,
    std::optional<at::ScalarType> table_dtype) {
  check_not_mixed_with_meta("add_position_backward_with_table",
                            {{"grad", &grad}, {"rng", &rng}, {"positions", optional_ptr(positions)}});
  check_dropout_probability(p);
  check_add_position_backward_inputs_if_concrete(grad, rng, positions, offset, batch_first, p,
                                                 table_len);
  TORCH_CHECK_VALUE(table_len.maybe_as_int().value_or(0) >= 0,
                    "posenc: expected table_len >= 0, got ", table_len);
  TORCH_CHECK(grad.dim() == 3, "posenc: expected grad to be a 3-D tensor, got shape ",
              grad.sym_sizes());
  const at::ScalarType out_dtype = table_gradient_dtype(grad, table_dtype);
  at::Tensor grad_x = need_x ? at::empty_symint(grad.sym_sizes(), grad.options())
                             : at::empty({0}, grad.options());
  at::Tensor grad_table =
      at::empty_symint({std::move(table_len), grad.sym_size(2)}, grad.options().dtype(out_dtype));
  return {grad_x, grad_table};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("add_position_forward", absent_if_undefined<&add_position_forward_meta>);
  m.impl("add_position_backward", &add_position_backward_meta);
  m.impl("add_position_backward_with_table",
         absent_if_undefined<&add_position_backward_with_table_meta>);
}

// ---- The ops composed from torch ops, for backends without a fused kernel
// (CompositeExplicitAutograd, the ATen fallback: aten_fallback.h): add_position_forward,
// add_position_backward and add_position_backward_with_table; table_gradient_composite, the
// differentiable form autograd uses under create_graph (twice-differentiable add_position);
// and scatter_rows_into_table, the deterministic row sum both build on.

// The masked gradient scattered into the table rows that were read, summed over the batch,
// in float32 (float64 for float64 grad). Deterministic: a reduction over the batch
// dimension, or index_put with accumulate, which is sort based on CUDA (index_add on the CPU).
at::Tensor table_gradient_composite(const at::Tensor& grad_x, const at::Tensor& positions,
                                    const c10::SymInt& offset, bool batch_first,
                                    const c10::SymInt& table_len) {
  const at::ScalarType acc = grad_x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (!positions.defined()) {
    // Rows offset .. offset + seq - 1, each read once per batch element.
    const at::Tensor summed = grad_x.sum({batch_first ? 0 : 1}, false, acc);
    const c10::SymInt seq = summed.sym_size(0);
    return at::constant_pad_nd_symint(summed, {0, 0, offset, table_len - offset - seq}, 0);
  }
  const at::Tensor rows = batch_first ? grad_x : grad_x.transpose(0, 1);  // (B, S, d)
  // (seq,) and (1, seq) positions serve every batch row.
  const at::Tensor pos = (positions.dim() == 1 ? positions.unsqueeze(0) : positions)
                             .expand_symint({rows.sym_size(0), rows.sym_size(1)});
  return scatter_rows_into_table(pos.reshape(-1),
                                 rows.reshape_symint({-1, rows.sym_size(2)}).to(acc), table_len);
}

at::Tensor scatter_rows_into_table(const at::Tensor& positions, const at::Tensor& rows,
                                   const c10::SymInt& table_len) {
  // Out-of-range positions go to a spare last row, dropped by the narrow: no sync, no assert.
  const at::Tensor inside = positions.ge(0).logical_and(positions.lt(c10::Scalar(table_len)));
  const at::Tensor safe = at::where(inside, positions, c10::Scalar(table_len));
  // rows.new_zeros and out of place: under torch.func.vmap (per-sample gradients, jacrev)
  // rows are batched, and so is the zero table new_zeros makes of them (at::zeros would not
  // be: in-place index_add_ refuses an unbatched self, and the out-of-place rule expands it,
  // which inductor in torch 2.11 then sums over the samples).
  const at::Tensor zero = rows.new_zeros_symint({table_len + 1, rows.sym_size(1)});
  // CPU index_put accumulates in parallel, in no fixed order; index_add walks the rows in
  // order (the ATen fallback's table gradient is then bitwise repeatable, as the kernels').
  const at::Tensor table = rows.is_cpu() ? zero.index_add(0, safe, rows)
                                         : zero.index_put({safe}, rows, /*accumulate=*/true);
  return table.narrow_symint(0, 0, table_len);
}

namespace {

// keep ? scale : 0 in the accumulation dtype (math::dropout_scale in it, as the kernels).
at::Tensor keep_factors(const at::Tensor& keep, double keep_prob, at::ScalarType acc) {
  const auto options = keep.options().dtype(acc);
  const double scale = acc == at::kDouble ? math::dropout_scale<double>(keep_prob)
                                          : static_cast<double>(math::dropout_scale<float>(keep_prob));
  return at::where(keep, at::scalar_tensor(scale, options), at::scalar_tensor(0.0, options));
}

// The kernels' forward: (x + table row) in float32 (float64 for float64 x), times the
// dropout factor, rounded once to x's dtype. The mask is posenc's Philox mask of a fresh key
// from the default CPU generator (the CPU kernel's draw, so a forced CPU fallback draws the
// CPU kernel's mask; on other devices it differs from what their kernels would draw). Positions
// outside [0, max_len) raise on the CPU, as the CPU kernel does, and give NaN rows elsewhere,
// as the CUDA kernel does (checking them would cost a device sync).
std::tuple<at::Tensor, at::Tensor> add_position_forward_composite(
    const at::Tensor& x_in, const at::Tensor& table_in, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, bool save_mask) {
  TORCH_CHECK_VALUE(!save_mask || x_in.device().is_cpu(), "posenc: add_position_forward: "
                    "save_mask=True (a saved dropout mask) is CPU-only; on ", x_in.device(),
                    " the backward regenerates the mask from rng");
  const AddPositionArgs g =
      check_add_position_inputs(x_in, table_in, positions, offset, batch_first, p);
  warn_aten_fallback("add_position", x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::ScalarType acc = accumulate_dtype(x);
  const at::Tensor table = table_as_matrix(table_in, x.scalar_type());
  // The rows read, (1 or batch, seq, d) in batch-first order; inside: which are in range.
  at::Tensor rows, inside;
  if (positions.has_value()) {
    const at::Tensor pos = positions->dim() == 1 ? positions->unsqueeze(0) : *positions;
    if (pos.is_cpu()) {
      check_positions_in_range_cpu(pos, g.table_len);
    } else {
      inside = pos.ge(0).logical_and(pos.lt(g.table_len)).unsqueeze(-1);
    }
    const at::Tensor safe = inside.defined() ? at::where(inside.squeeze(-1), pos, 0) : pos;
    rows = table.index_select(0, safe.reshape({-1})).view({pos.size(0), pos.size(1), g.d});
  } else {
    rows = table.narrow(0, offset, g.seq).unsqueeze(0);
  }
  if (!batch_first) {
    rows = rows.transpose(0, 1);
    if (inside.defined()) inside = inside.transpose(0, 1);
  }
  at::Tensor sum = x.to(acc) + rows.to(acc);
  if (inside.defined()) sum = at::where(inside, sum, std::numeric_limits<double>::quiet_NaN());
  at::Tensor rng = at::empty({p > 0.0 ? 2 : 0}, x.options().dtype(at::kLong));
  if (p > 0.0) {
    uint64_t seed;
    {
      auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
          std::nullopt, at::detail::getDefaultCPUGenerator());
      std::lock_guard<std::mutex> lock(gen->mutex_);
      seed = gen->random64();
    }
    const auto params = math::make_dropout_params(p);
    const at::Tensor keep = dropout_keep_composite(seed, 0, params.threshold, x.sizes(), x.device());
    sum = sum * keep_factors(keep, params.keep_prob, acc);
    if (save_mask) {
      rng = pack_keep_bits_composite(keep);
    } else {
      rng = at::tensor({static_cast<int64_t>(seed), int64_t{0}}, at::kLong).to(x.device());
    }
  }
  return {sum.to(x.scalar_type()).contiguous(), rng};
}

// grad * mask * scale, rounded once to grad's dtype; the mask read from the saved bits or
// regenerated from the (seed, offset) key (read back to the host: one sync off the CPU).
at::Tensor add_position_backward_composite(const at::Tensor& grad_in, const at::Tensor& rng,
                                           double p) {
  check_dropout_backward_args(grad_in, rng, p);
  warn_aten_fallback("add_position_backward", grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  if (grad.numel() == 0) return at::empty_like(grad);
  const auto params = math::make_dropout_params(p);
  at::Tensor keep;
  if (rng.scalar_type() == at::kByte) {
    keep = unpack_keep_bits_composite(rng, grad.size(2));
  } else {
    const at::Tensor key = rng.to(at::kCPU).contiguous();
    keep = dropout_keep_composite(static_cast<uint64_t>(key.const_data_ptr<int64_t>()[0]),
                                  static_cast<uint64_t>(key.const_data_ptr<int64_t>()[1]),
                                  params.threshold, grad.sizes(), grad.device());
  }
  const at::ScalarType acc = accumulate_dtype(grad);
  return (grad.to(acc) * keep_factors(keep, params.keep_prob, acc)).to(grad.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_composite(
    const at::Tensor& grad, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    c10::SymInt offset, bool batch_first, double p, c10::SymInt table_len, bool need_x,
    std::optional<at::ScalarType> table_dtype) {
  // The checks of the fused kernels (offset range, rng, p, positions layout).
  check_add_position_backward_inputs_if_concrete(grad, rng, positions, offset, batch_first, p,
                                                 table_len);
  const at::ScalarType out_dtype = table_gradient_dtype(grad, table_dtype);
  warn_aten_fallback("add_position_backward_with_table", grad.device());
  const at::Tensor masked = p > 0.0 ? add_position_backward_op().call(grad, rng, p) : grad;
  at::Tensor grad_table = table_gradient_composite(masked, positions.value_or(at::Tensor()),
                                                   offset, batch_first, table_len)
                              .to(out_dtype);
  at::Tensor grad_x = !need_x ? at::empty({0}, grad.options())
                              : (p > 0.0 ? masked : grad.clone(at::MemoryFormat::Contiguous));
  return {grad_x, grad_table};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("add_position_forward", absent_if_undefined<&add_position_forward_composite>);
  m.impl("add_position_backward", &add_position_backward_composite);
  m.impl("add_position_backward_with_table",
         absent_if_undefined<&add_position_backward_with_table_composite>);
}

// ---- The CPU backend (see the file comment).

namespace {

cpu::DropoutArgs dropout_params(double p) {
  const auto params = math::make_dropout_params(p);
  cpu::DropoutArgs draw;
  draw.active = true;
  draw.threshold = params.threshold;
  draw.keep_prob = params.keep_prob;
  return draw;
}

// A fresh 64-bit key per call from the default CPU generator, so torch.manual_seed
// reproduces runs and successive calls draw different masks.
cpu::DropoutArgs draw_cpu(double p) {
  cpu::DropoutArgs draw = dropout_params(p);
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  draw.seed = gen->random64();
  draw.offset = 0;
  return draw;
}

// The draw of a forward call, read back from its (seed, offset) rng tensor (validated by
// the caller).
cpu::DropoutArgs draw_from_rng(const at::Tensor& rng, double p) {
  cpu::DropoutArgs draw = dropout_params(p);
  const at::Tensor state = rng.contiguous();
  draw.seed = static_cast<uint64_t>(state.const_data_ptr<int64_t>()[0]);
  draw.offset = static_cast<uint64_t>(state.const_data_ptr<int64_t>()[1]);
  return draw;
}

at::Tensor rng_tensor(const cpu::DropoutArgs& draw) {
  if (!draw.active) return at::empty({0}, at::TensorOptions().dtype(at::kLong));
  at::Tensor rng = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  rng.mutable_data_ptr<int64_t>()[0] = static_cast<int64_t>(draw.seed);
  rng.mutable_data_ptr<int64_t>()[1] = static_cast<int64_t>(draw.offset);
  return rng;
}

// The draw of a backward call: the saved keep mask (uint8, checked by the caller) or the key.
cpu::DropoutArgs backward_draw(const at::Tensor& rng, double p, at::Tensor& mask_holder) {
  if (rng.scalar_type() != at::kByte) return draw_from_rng(rng, p);
  cpu::DropoutArgs draw = dropout_params(p);
  mask_holder = rng.contiguous();
  draw.keep_bits = mask_holder.const_data_ptr<uint8_t>();
  return draw;
}

std::tuple<at::Tensor, at::Tensor> add_position_forward_cpu(
    const at::Tensor& x_in, const at::Tensor& table_in, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, bool save_mask) {
  const AddPositionArgs g =
      check_add_position_inputs(x_in, table_in, positions, offset, batch_first, p);
  at::Tensor pos;
  if (positions.has_value()) {
    pos = positions->contiguous();
    check_positions_in_range_cpu(pos, g.table_len);
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor table = table_as_matrix(table_in, x.scalar_type());
  at::Tensor out = empty_output(x.sizes(), x.options());
  cpu::DropoutArgs draw = p > 0.0 ? draw_cpu(p) : cpu::DropoutArgs{};
  at::Tensor mask;
  if (save_mask && draw.active) {
    mask = at::empty({x.size(0), x.size(1), cpu::keep_row_bytes(g.d)}, x.options().dtype(at::kByte));
    draw.keep_bits_out = mask.mutable_data_ptr<uint8_t>();
  }
  if (x.numel() > 0) {
    cpu::add_position_forward_stub::get()(
        g, x.scalar_type(), table.scalar_type() != x.scalar_type(), x.const_data_ptr(),
        table.const_data_ptr(), pos.defined() ? pos.const_data_ptr<int64_t>() : nullptr, draw,
        out.mutable_data_ptr());
  }
  return {out, mask.defined() ? mask : rng_tensor(draw)};
}

at::Tensor add_position_backward_cpu(const at::Tensor& grad_in, const at::Tensor& rng, double p) {
  check_dropout_backward_args(grad_in, rng, p);
  at::Tensor mask;
  const cpu::DropoutArgs draw = backward_draw(rng, p, mask);
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor out = empty_output(grad.sizes(), grad.options());
  if (grad.numel() == 0) return out;
  // With a saved mask grad is 3-D (checked): rows of size(2); with the key any split works.
  const int64_t d = mask.defined() ? grad.size(2) : grad.numel();
  cpu::dropout_backward_stub::get()(grad.scalar_type(), grad.const_data_ptr(), grad.numel() / d,
                                    d, draw, out.mutable_data_ptr());
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_cpu(
    const at::Tensor& grad_in, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, int64_t table_len, bool need_x,
    std::optional<at::ScalarType> table_dtype) {
  const AddPositionArgs g = check_add_position_backward_inputs(
      grad_in, rng, positions, offset, batch_first, p, table_len);
  const at::ScalarType out_dtype = table_gradient_dtype(grad_in, table_dtype);
  at::Tensor pos;
  std::pair<int64_t, int64_t> span{0, -1};  // the rows positions read
  if (positions.has_value()) {
    pos = positions->contiguous();
    span = check_positions_in_range_cpu(pos, g.table_len);
  }
  at::Tensor mask;
  const cpu::DropoutArgs draw = p > 0.0 ? backward_draw(rng, p, mask) : cpu::DropoutArgs{};
  const at::Tensor grad = grad_in.contiguous();
  const at::ScalarType acc = accumulate_dtype(grad);
  at::Tensor grad_x = need_x ? empty_output(grad.sizes(), grad.options())
                             : at::empty({0}, grad.options());
  if (grad.numel() == 0) return {grad_x, at::zeros({table_len, g.d}, grad.options().dtype(out_dtype))};
  // Without positions the kernel writes rows offset .. offset + seq - 1 once each, in the
  // accumulation dtype or in grad's (a bfloat16 or float16 table of bfloat16 or float16 x):
  // only the other rows are zeroed, and no float32 table is converted afterwards. With
  // positions it adds into zeroed rows in the accumulation dtype: the table itself, or, for a
  // table in another dtype, only the rows between the smallest and the largest position
  // (g.table_row_base: the first), converted into a table zeroed elsewhere.
  const bool rows_once = !pos.defined() && (out_dtype == acc || out_dtype == grad.scalar_type());
  const bool window = pos.defined() && out_dtype != acc;
  at::Tensor grad_table, sums;
  AddPositionArgs args = g;
  if (pos.defined() && positions_distinct(pos)) {
    args.positions_batch_stride = 0;
    args.positions_distinct = true;
  }
  if (rows_once) {
    grad_table = sums = table_zeroed_outside(table_len, g.d, offset, g.seq, grad.options().dtype(out_dtype));
  } else if (window) {
    args.table_row_base = span.first;
    sums = at::zeros({span.second - span.first + 1, g.d}, grad.options().dtype(acc));
  } else {
    grad_table = sums = at::zeros({table_len, g.d}, grad.options().dtype(acc));
  }
  cpu::add_position_backward_stub::get()(
      args, grad.scalar_type(), grad.const_data_ptr(),
      pos.defined() ? pos.const_data_ptr<int64_t>() : nullptr, draw,
      need_x ? grad_x.mutable_data_ptr() : nullptr, sums.mutable_data_ptr(),
      /*table_in_grad_dtype=*/out_dtype != acc && rows_once);
  if (window) {
    grad_table = table_zeroed_outside(table_len, g.d, span.first, sums.size(0), grad.options().dtype(out_dtype));
    grad_table.narrow(0, span.first, sums.size(0)).copy_(sums);
  }
  return {grad_x, grad_table.to(out_dtype)};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("add_position_backward_with_table",
         absent_if_undefined<&add_position_backward_with_table_cpu>);
  m.impl("add_position_forward", absent_if_undefined<&add_position_forward_cpu>);
  m.impl("add_position_backward", &add_position_backward_cpu);
}

}  // namespace ops
}  // namespace posenc

// ---- CUDA backend: the same checks, contiguous inputs, outputs from torch's allocator, the
// dropout state from the device's default generator, and the launches of
// cuda/add_position/add_position.cu's kernels on x's device and current stream.
#if defined(POSENC_WITH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/add_position/launch.h"

namespace posenc {
namespace ops {
namespace {

std::tuple<at::Tensor, at::Tensor> add_position_forward_cuda(
    const at::Tensor& x_in, const at::Tensor& table_in, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, bool save_mask) {
  TORCH_CHECK_VALUE(!save_mask, "posenc: add_position_forward: save_mask=True (a saved dropout "
                    "mask) is CPU-only; on CUDA the backward regenerates the mask from rng");
  AddPositionForwardLaunch f;
  f.g = check_add_position_inputs(x_in, table_in, positions, offset, batch_first, p);
  const c10::cuda::CUDAGuard device_guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor table = table_as_matrix(table_in, x.scalar_type());
  const at::Tensor pos = positions.has_value() ? positions->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());

  CudaDropoutArgs& dropout = f.dropout;
  // An empty x has no mask to draw (and backward never reads its rng).
  dropout.active = p > 0.0 && x.numel() > 0;
  at::Tensor rng = at::empty({dropout.active ? 2 : 0}, x.options().dtype(at::kLong));
  if (dropout.active) {
    const auto params = math::make_dropout_params(p);
    dropout.threshold = params.threshold;
    dropout.keep_prob = params.keep_prob;
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(x.device().index()));
    std::lock_guard<std::mutex> lock(gen->mutex_);
    // One 128-bit Philox draw per block of 8 elements, each block its own subsequence (see
    // posenc/math/philox.h): 4 offsets, as a torch kernel whose threads draw once.
    dropout.philox = gen->philox_cuda_state(4);
  }
  if (x.numel() == 0) {
    if (p > 0.0) rng = at::zeros({2}, x.options().dtype(at::kLong));
    return {out, rng};
  }
  f.x = x.const_data_ptr();
  f.table = table.const_data_ptr();
  f.table_same_dtype = table.scalar_type() == x.scalar_type();
  f.positions = pos.defined() ? pos.const_data_ptr<int64_t>() : nullptr;
  f.out = out.mutable_data_ptr();
  f.numel = x.numel();
  f.rng_out = dropout.active ? rng.mutable_data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "posenc_add_position_cuda", [&] {
    C10_CUDA_CHECK(launch_add_position_forward<scalar_t>(f, at::cuda::getCurrentCUDAStream()));
  });
  return {out, rng};
}

at::Tensor add_position_backward_cuda(const at::Tensor& grad_in, const at::Tensor& rng, double p) {
  check_dropout_backward_args(grad_in, rng, p);
  const c10::cuda::CUDAGuard device_guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor state = rng.contiguous();
  at::Tensor out = at::empty(grad.sizes(), grad.options());
  if (grad.numel() == 0) return out;
  const auto params = math::make_dropout_params(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_add_position_backward_cuda", [&] {
    C10_CUDA_CHECK(launch_add_position_backward<scalar_t>(grad.const_data_ptr(), out.mutable_data_ptr(), grad.numel(),
                                                          state.const_data_ptr<int64_t>(), params.threshold,
                                                          params.keep_prob, at::cuda::getCurrentCUDAStream()));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_position_backward_with_table_cuda(
    const at::Tensor& grad_in, const at::Tensor& rng, const std::optional<at::Tensor>& positions,
    int64_t offset, bool batch_first, double p, int64_t table_len, bool need_x,
    std::optional<at::ScalarType> table_dtype) {
  const AddPositionArgs g = check_add_position_backward_inputs(
      grad_in, rng, positions, offset, batch_first, p, table_len);
  const at::ScalarType out_dtype = table_gradient_dtype(grad_in, table_dtype);
  const c10::cuda::CUDAGuard device_guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::ScalarType acc = accumulate_dtype(grad);
  at::Tensor grad_x = need_x ? at::empty(grad.sizes(), grad.options())
                             : at::empty({0}, grad.options());
  const bool sorted = positions.has_value() && g.positions_batch_stride != 0;  // (batch, seq) positions
  // The table gradient starts at zero, except on the (seq,) positions path, which builds it
  // from the per-s sums (scatter_rows_into_table) and would discard a zeroed table. Without
  // positions in another dtype than the accumulation's, the sums go to a (seq, d) buffer and
  // only those rows are converted (no float32 table converted whole).
  const bool rows_in_buffer = !positions.has_value() && out_dtype != acc;
  at::Tensor grad_table;
  if (grad.numel() == 0 || (!positions.has_value() && !rows_in_buffer) || sorted) {
    grad_table = at::zeros({table_len, g.d}, grad.options().dtype(grad.numel() == 0 ? out_dtype : acc));
  }
  if (grad.numel() == 0) return {grad_x, grad_table};
  const auto params = math::make_dropout_params(p);
  const at::Tensor state = p > 0.0 ? rng.contiguous() : at::Tensor();
  const TableBackwardArgs args{g.batch, g.seq, g.d, g.batch_first,
                               p > 0.0 ? state.const_data_ptr<int64_t>() : nullptr, params.threshold,
                               params.keep_prob};
  void* gx = need_x ? grad_x.mutable_data_ptr() : nullptr;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (sorted) {
    // (batch, seq) positions: each memory row's table row (table_len for one outside the
    // table), sorted stably; the two passes sum each run of equal keys.
    const at::Tensor pos = batch_first ? *positions : positions->t();  // memory-row order
    at::Tensor flat = pos.reshape({-1});
    flat = at::where(flat.ge(0).logical_and(flat.lt(table_len)), flat, table_len);
    at::Tensor keys, rows;  // (not a structured binding: the lambda below captures rows)
    std::tie(keys, rows) = at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const SortedRuns runs{keys.const_data_ptr<int64_t>(), g.batch * g.seq, sorted_runs_chunk(g.batch * g.seq)};
    at::Tensor start = at::empty({runs.chunks(), g.d}, grad.options().dtype(acc));
    at::Tensor carry = at::empty({runs.chunks(), g.d}, grad.options().dtype(acc));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_add_position_backward_table_cuda", [&] {
      C10_CUDA_CHECK(launch_add_position_backward_table_sorted<scalar_t>(
          args, grad.const_data_ptr(), gx, grad_table.mutable_data_ptr(), start.mutable_data_ptr(),
          carry.mutable_data_ptr(), runs, rows.const_data_ptr<int64_t>(), table_len, stream));
    });
    return {grad_x, grad_table.to(out_dtype)};
  }
  // Sums per s: straight into rows offset + s of the table, or into a buffer when the
  // (seq,) positions may send two s to one row or the table is in another dtype.
  at::Tensor sums = positions.has_value() || rows_in_buffer
                        ? at::empty({g.seq, g.d}, grad.options().dtype(acc))
                        : grad_table.narrow(0, offset, g.seq);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_add_position_backward_table_cuda", [&] {
    C10_CUDA_CHECK(launch_add_position_backward_table<scalar_t>(args, grad.const_data_ptr(), gx,
                                                                sums.mutable_data_ptr(), stream));
  });
  if (positions.has_value()) grad_table = scatter_rows_into_table(positions->reshape({-1}), sums, table_len);
  if (rows_in_buffer) {
    grad_table = table_zeroed_outside(table_len, g.d, offset, g.seq, grad.options().dtype(out_dtype));
    grad_table.narrow(0, offset, g.seq).copy_(sums);
  }
  return {grad_x, grad_table.to(out_dtype)};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("add_position_forward", absent_if_undefined<&add_position_forward_cuda>);
  m.impl("add_position_backward", &add_position_backward_cuda);
  m.impl("add_position_backward_with_table",
         absent_if_undefined<&add_position_backward_with_table_cuda>);
}

}  // namespace ops
}  // namespace posenc
#endif  // POSENC_WITH_CUDA
