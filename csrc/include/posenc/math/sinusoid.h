// The sinusoidal encoding of Vaswani et al. (2017), sec. 3.5, column by column:
//   PE(pos, 2i)   = sin(pos * base^(-2i/d))
//   PE(pos, 2i+1) = cos(pos * base^(-2i/d))
// Column j uses the frequency index i = j / 2, so an odd d ends with a sine column.
// Everything is evaluated in double precision and rounded once by the caller: the
// angle pos * freq is the ill-conditioned part (pos up to max_len), and a float32
// angle would cost up to ~3e-4 absolute error at pos = 5000.
#pragma once

#include <cmath>
#include <cstdint>

#include "posenc/math/host_device.h"

namespace posenc {
namespace math {

POSENC_ISA_NAMESPACE_BEGIN

// base^(-2i/d) for column j, as exp(-(2i/d) * ln(base)) (the classic formulation).
POSENC_HOST_DEVICE double sinusoid_inv_freq(int64_t column, int64_t d_model,
                                            double log_base) {
  const double two_i = static_cast<double>(column - (column & 1));
  return exp(-two_i * log_base / static_cast<double>(d_model));
}

// The entry of `column` at `position`, given that column's frequency (sinusoid_inv_freq,
// computed once on the host by every backend: a device's exp may differ from the host's libm
// in the last bit, which moves the angle at position p by about p ulps).
POSENC_HOST_DEVICE double sinusoid_value(double position, int64_t column, double freq) {
  const double angle = position * freq;
  return (column & 1) ? cos(angle) : sin(angle);
}

// The same with the frequency computed here (this side's exp).
POSENC_HOST_DEVICE double sinusoid_value(double position, int64_t column, int64_t d_model,
                                         double log_base) {
  return sinusoid_value(position, column, sinusoid_inv_freq(column, d_model, log_base));
}

POSENC_ISA_NAMESPACE_END

}  // namespace math
}  // namespace posenc
