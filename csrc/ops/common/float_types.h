// The floating-point dtypes posenc computes in (its kernels' and tables' dtypes), stated once
// for the C++ checks (Python's front ends: _common._TABLE_DTYPES).
#pragma once

#include <c10/core/ScalarType.h>

namespace posenc {
namespace ops {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace ops
}  // namespace posenc
