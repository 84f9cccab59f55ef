// CPU backend of add_position_forward / add_position_backward: argument checks, the
// dropout draw from the default CPU generator, and the call of the vectorised kernels in
// cpu/kernel.cpp (built once per vector ISA, chosen at run time: cpu_capability.h).
//
// save_mask (set by autograd for CPU training): the forward returns the keep mask, one bit
// per element (cpu::DropoutArgs), in place of the (seed, offset) key, and the backward ops
// read it instead of regenerating it. Reading 1 bit per element is cheaper on a CPU than
// running Philox again (benchmarks/NOTES.md); CUDA keeps regenerating (its Philox is free
// beside the memory traffic), so no tensor of x's size is saved there.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>

#include "ops/add_position/add_position_checks.h"
#include "ops/add_position/cpu/kernel.h"
#include "ops/common/cpu/cpu_support.h"
#include "posenc/math/philox.h"

namespace posenc {
namespace ops {


namespace {

cpu::DropoutArgs dropout_params(double p) {
  const auto params = math::make_dropout_params(p);
  cpu::DropoutArgs draw;
  draw.active = true;
  draw.threshold = params.threshold;
  draw.scale = params.scale;
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
    int64_t offset, bool batch_first, double p, int64_t table_len, bool need_x) {
  const AddPositionArgs g = check_add_position_backward_inputs(
      grad_in, rng, positions, offset, batch_first, p, table_len);
  at::Tensor pos;
  if (positions.has_value()) {
    pos = positions->contiguous();
    check_positions_in_range_cpu(pos, g.table_len);
  }
  at::Tensor mask;
  const cpu::DropoutArgs draw = p > 0.0 ? backward_draw(rng, p, mask) : cpu::DropoutArgs{};
  const at::Tensor grad = grad_in.contiguous();
  const at::ScalarType acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_x = need_x ? empty_output(grad.sizes(), grad.options())
                             : at::empty({0}, grad.options());
  at::Tensor grad_table = at::zeros({table_len, g.d}, grad.options().dtype(acc));
  if (grad.numel() == 0) return {grad_x, grad_table};
  cpu::add_position_backward_stub::get()(
      g, grad.scalar_type(), grad.const_data_ptr(),
      pos.defined() ? pos.const_data_ptr<int64_t>() : nullptr, draw,
      need_x ? grad_x.mutable_data_ptr() : nullptr, grad_table.mutable_data_ptr());
  return {grad_x, grad_table};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("add_position_backward_with_table", &add_position_backward_with_table_cpu);
  m.impl("add_position_forward", &add_position_forward_cpu);
  m.impl("add_position_backward", &add_position_backward_cpu);
}

}  // namespace ops
}  // namespace posenc
