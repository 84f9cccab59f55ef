// The shared pieces of the ATen fallback (aten_fallback.h): the warning and
// posenc's dropout mask in tensor ops.
#include "ops/common/aten_fallback.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <string>

#include "posenc/math/philox.h"

namespace posenc {
namespace ops {

namespace {

std::string how_to_get_kernels(const at::Device& device) {
  if (device.is_cpu()) {
    return "because the call was sent to it (posenc's CPU kernels are the default; the tests "
           "reach this composite through the dispatcher)";
  }
  if (device.is_cuda()) {
    return "because this posenc library was built without its CUDA kernels (no nvcc at build "
           "time); for them, install the CUDA toolkit that matches torch.version.cuda and "
           "reinstall posenc (pip install --no-build-isolation .; POSENC_WITH_CUDA=1 makes a "
           "missing nvcc an error)";
  }
  return "because posenc has fused kernels for CPU and CUDA tensors only";
}

}  // namespace

void warn_aten_fallback(const char* op, const at::Device& device) {
  TORCH_WARN_ONCE("posenc: ", op, " on ", device.type(), " tensors runs as a composition of "
                  "ATen ops (several passes over memory and temporaries instead of one fused "
                  "kernel: slower) ", how_to_get_kernels(device),
                  ". This warning is shown once per process.");
}

at::ScalarType fallback_wide_dtype(const at::Device& device) {
  return device.is_mps() ? at::kFloat : at::kDouble;
}

namespace {

constexpr int64_t kLow32 = 0xFFFFFFFFll;

// (hi, lo) 32-bit halves of a * m, for uint32 values a held in an int64 tensor: m split into
// 16-bit halves, so no product exceeds 2^48 (no int64 overflow on any device).
void mulhilo(const at::Tensor& a, uint32_t m, at::Tensor& hi, at::Tensor& lo) {
  const at::Tensor ph = a * static_cast<int64_t>(m >> 16);
  const at::Tensor pl = a * static_cast<int64_t>(m & 0xFFFFu);
  hi = at::bitwise_right_shift(ph + at::bitwise_right_shift(pl, 16), 16);
  lo = (at::bitwise_left_shift(ph.bitwise_and(0xFFFF), 16) + pl).bitwise_and(kLow32);
}

}  // namespace

at::Tensor dropout_keep_composite(uint64_t seed, uint64_t offset, uint32_t threshold,
                                  at::IntArrayRef sizes, const at::Device& device) {
  const int64_t numel = c10::multiply_integers(sizes);
  const int64_t blocks = (numel + math::kDropoutBlock - 1) / math::kDropoutBlock;
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  // The counters of math::dropout_counter: (offset / 4 low, high word, block low, high).
  const at::Tensor block = at::arange(blocks, options);
  at::Tensor c0 = at::full({blocks}, static_cast<int64_t>((offset >> 2) & kLow32), options);
  at::Tensor c1 = at::full({blocks}, static_cast<int64_t>((offset >> 34) & kLow32), options);
  at::Tensor c2 = block.bitwise_and(kLow32);
  at::Tensor c3 = at::bitwise_right_shift(block, 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < math::kPhiloxRounds; ++round) {  // math::philox_round
    at::Tensor hi0, lo0, hi1, lo1;
    mulhilo(c0, math::kPhiloxMul0, hi0, lo0);
    mulhilo(c2, math::kPhiloxMul1, hi1, lo1);
    c0 = hi1.bitwise_xor(c1).bitwise_xor(static_cast<int64_t>(k0));
    c1 = lo1;
    c2 = hi0.bitwise_xor(c3).bitwise_xor(static_cast<int64_t>(k1));
    c3 = lo0;
    k0 += math::kPhiloxWeyl0;
    k1 += math::kPhiloxWeyl1;
  }
  // Element e takes the 16 bits math::dropout_lane_bits gives lane e % 8 of block e / 8:
  // word (e % 8) / 2, low half first.
  const at::Tensor words = at::stack({c0, c1, c2, c3}, 1);
  const at::Tensor bits16 =
      at::stack({words.bitwise_and(0xFFFF), at::bitwise_right_shift(words, 16)}, 2);
  return bits16.reshape({-1}).narrow(0, 0, numel).ge(static_cast<int64_t>(threshold)).reshape(sizes);
}

at::Tensor pack_keep_bits_composite(const at::Tensor& keep) {
  const int64_t d = keep.size(2);
  const int64_t bytes = (d + 7) / 8;
  const at::Tensor padded = at::constant_pad_nd(keep.to(at::kByte), {0, bytes * 8 - d}, 0);
  const at::Tensor weights = at::bitwise_left_shift(
      at::ones({8}, keep.options().dtype(at::kByte)), at::arange(8, keep.options().dtype(at::kByte)));
  return (padded.view({keep.size(0), keep.size(1), bytes, 8}) * weights).sum(-1, false, at::kByte);
}

at::Tensor unpack_keep_bits_composite(const at::Tensor& bits, int64_t d) {
  const at::Tensor lane = at::arange(8, bits.options());
  const at::Tensor unpacked = at::bitwise_right_shift(bits.unsqueeze(-1), lane).bitwise_and(1);
  return unpacked.reshape({bits.size(0), bits.size(1), -1}).narrow(2, 0, d).ne(0);
}

void assert_all_on_device(const at::Tensor& ok, const char* message) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::_assert_async", "msg");
  const c10::DispatchKey key = c10::computeDispatchKey(std::nullopt, std::nullopt, ok.device());
  if (op.hasKernelForDispatchKey(key)) at::_assert_async(ok.all(), message);
}

at::Tensor steps_like(const at::Tensor& like, int64_t n) {
  at::Tensor out = like.new_empty({n}, at::TensorOptions(at::kLong));  // like's device
  return at::arange_out(out, n);
}

void write_paged_rows(const at::Tensor& cache, const at::Tensor& values, const at::Tensor& slots,
                      const at::Tensor& unwritten, const at::Tensor& block, const at::Tensor& index) {
  const at::Tensor hits = slots.eq(0);
  const at::Tensor first = hits.to(at::kInt).argmax().view({1});  // 0 when no item hits
  const at::Tensor slot0 = at::where(hits.any(), values.index_select(0, first).squeeze(0),
                                     cache.select(0, 0).select(0, 0));
  cache.index_put_({block, index}, at::where(unwritten.view({-1, 1, 1}), slot0.unsqueeze(0), values));
}

}  // namespace ops
}  // namespace posenc
