// posenc::make_positions: fairseq's padding-aware positions. The one definition behind
// posenc.functional.make_positions (Python) and posenc::make_positions (C++). Made of ATen
// ops (CompositeImplicitAutograd), so it runs on any device and traces under torch.compile.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <string>

#include "ops/common/py_format.h"

namespace posenc {
namespace ops {
namespace {

at::Tensor make_positions(const at::Tensor& tokens, int64_t padding_idx, c10::SymInt offset) {
  // One message for "integer (batch, seq)": TypeError for a dtype that is not an integer one
  // (as add_position's float positions), ValueError for a shape.
  const auto expected = [&] {
    return c10::str("make_positions: expected integer tokens of shape (batch, seq), got ",
                    py_dtype(tokens.scalar_type()), " tokens of shape ", py_tuple(tokens.sizes()));
  };
  TORCH_CHECK_TYPE(!tokens.is_floating_point() && !tokens.is_complex(), expected());
  TORCH_CHECK_VALUE(tokens.dim() == 2, expected());
  constexpr int64_t kLimit = int64_t{1} << 62;
  TORCH_CHECK_VALUE(padding_idx >= -kLimit && padding_idx <= kLimit,
                    "make_positions: expected padding_idx within +-2**62, got ", padding_idx);
  // offset (transformers' past_key_values_length): the tokens before these, in a cache. Not
  // negative: a non-padding token would be numbered like padding. A SymInt: torch.compile
  // keeps a decoding loop's offset dynamic (these comparisons guard, they do not specialise;
  // a failing one shows the value, made concrete then).
  const auto shown = [](const c10::SymInt& v) { return v.guard_int(__FILE__, __LINE__); };
  TORCH_CHECK_VALUE(offset >= 0 && offset <= kLimit, "make_positions: expected offset in [0, 2**62], got ",
                    shown(offset));
  // The largest position, padding_idx + offset + seq, must stay an int64 (it wrapped to
  // negative positions for padding_idx = offset = 2**62): padding_idx <= INT64_MAX - offset -
  // seq, whose right side cannot wrap (0 <= offset <= 2**62, 0 <= seq < 2**62).
  const c10::SymInt seq = tokens.sym_size(1);
  TORCH_CHECK_VALUE(padding_idx <= c10::SymInt(std::numeric_limits<int64_t>::max()) - offset - seq,
                    "make_positions: expected the last position, padding_idx + offset + seq, to fit in int64, "
                    "got padding_idx=", padding_idx, ", offset=", shown(offset), ", seq=", shown(seq));
  // Compared in int64: ne() with a scalar converts padding_idx into the tokens' dtype, which
  // wraps (300 as uint8 is 44: tokens 44 taken for padding).
  const at::Tensor mask = tokens.to(at::kLong).ne(padding_idx).to(at::kLong);
  return (at::cumsum(mask, 1) + c10::Scalar(offset)) * mask + padding_idx;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
  // int64 (batch, seq): non-padding tokens numbered padding_idx + offset + 1,
  // padding_idx + offset + 2, ... along dim 1, padding tokens padding_idx.
  m.def("make_positions(Tensor tokens, int padding_idx, SymInt offset=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(posenc, CompositeImplicitAutograd, m) {
  m.impl("make_positions", &make_positions);
}

// Under vmap the same composite, its ATen ops batched (as resample_position_table): without
// this, functorch's per-sample fallback ran it once per sample, with its warning.
TORCH_LIBRARY_IMPL(posenc, FuncTorchBatchedDecomposition, m) {
  m.impl("make_positions", &make_positions);
}

}  // namespace ops
}  // namespace posenc
