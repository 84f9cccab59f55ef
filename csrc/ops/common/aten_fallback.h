// The ATen fallback: every posenc op also has a kernel composed of ATen ops, registered under
// CompositeExplicitAutograd, which the dispatcher takes for every backend that has no posenc
// kernel of its own: CUDA in a library built without the CUDA kernels (pip install on a
// machine without nvcc), MPS, XPU and the rest. A backend kernel (CPU, CUDA, Meta) wins over
// it, and autograd still goes through posenc's C++ autograd kernels (Autograd key), which
// call the ops below autograd. The numbers are those of the reference formulas to the
// device's rounding, with the same checks and messages as the kernels; dropout draws the
// same Philox bits as the kernels (posenc/math/philox.h, in int64 tensor ops).
//
// The tests reach it for CPU tensors through the dispatcher, by redispatching each posenc op
// to its CompositeExplicitAutograd kernel (tests/python/aten_fallback_mode.py), and compare
// it with the CPU kernels (tests/python/test_aten_fallback.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace posenc {
namespace ops {

// The one-time warning of the fallback (the first op and device that take it).
void warn_aten_fallback(const char* op, const at::Device& device);

// The float dtype the fallback computes angles in: float64, float32 where the device has no
// float64 (MPS).
at::ScalarType fallback_wide_dtype(const at::Device& device);

// The dropout keep decisions of elements 0 .. numel - 1 of a call with key (seed, offset)
// and threshold (posenc/math/philox.h: keep iff the element's 16 Philox bits >= threshold),
// as a bool tensor of `sizes` (row-major) on `device`.
at::Tensor dropout_keep_composite(uint64_t seed, uint64_t offset, uint32_t threshold,
                                  at::IntArrayRef sizes, const at::Device& device);

// The saved keep mask of the CPU kernels (1 bit per element, rows of (d + 7) / 8 bytes:
// ops/add_position/cpu/kernel.h, DropoutArgs) from a (B0, B1, d) bool tensor, and back.
at::Tensor pack_keep_bits_composite(const at::Tensor& keep);
at::Tensor unpack_keep_bits_composite(const at::Tensor& bits, int64_t d);

// The KV-cache ops' composites (rope_append_kv, rope_shift_kv_), which must neither read a
// device tensor back nor leave a row out:
// - fails on the device, without a host sync, unless every element of `ok` is true, through
//   at::_assert_async where the device has a kernel for it (CPU, CUDA); elsewhere the callers'
//   out-of-range index is what fails;
void assert_all_on_device(const at::Tensor& ok, const char* message);
// - 0 .. n - 1 as int64 on like's device, made by an op on `like` (new_empty, arange_out) rather
//   than a factory, so that a tensor subclass standing for a device sees every op (the tests'
//   OnDevice);
at::Tensor steps_like(const at::Tensor& like, int64_t n);
// - rows `values` (n, heads, d) into the paged cache (num_blocks, block_size, heads, d) at
//   (block, index); the items of `unwritten` (slot -1) write into slot 0 the value slot 0 ends
//   with (that of the item writing it, or its current value), so whichever store wins slot 0
//   holds the same bits: no mask, no slot read. A block index of num_blocks makes index_put_
//   refuse an out-of-range slot.
void write_paged_rows(const at::Tensor& cache, const at::Tensor& values, const at::Tensor& slots,
                      const at::Tensor& unwritten, const at::Tensor& block, const at::Tensor& index);

}  // namespace ops
}  // namespace posenc
