// Values written in error messages the way Python writes them (repr), so that a message
// raised by an op reads the same from Python and from C++: 1.0 not 1, (4, 5) not [4, 5],
// torch.int64 not Long, 'bogus' with its quotes.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace posenc {
namespace ops {

// Python's repr(float): the shortest digits that round-trip, fixed notation for decimal
// exponents -4 .. 15 (with ".0" when integral), else "1.5e-07" / "1e+16"; nan, inf, -inf.
inline std::string py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // e.g. "-1.2345e+02"
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e_pos = sci.find('e');
  const int exp10 = std::atoi(sci.c_str() + e_pos + 1);
  std::string digits = sci.substr(0, e_pos);
  if (digits.size() > 1) digits.erase(1, 1);  // drop the '.'
  const int n = static_cast<int>(digits.size());
  if (exp10 >= -4 && exp10 < 16) {
    if (exp10 < 0) return sign + "0." + std::string(-exp10 - 1, '0') + digits;
    std::string int_part = digits.substr(0, std::min(n, exp10 + 1));
    int_part.append(std::max(0, exp10 + 1 - n), '0');
    const std::string frac = n > exp10 + 1 ? digits.substr(exp10 + 1) : "0";
    return sign + int_part + "." + frac;
  }
  std::string mantissa = digits.substr(0, 1);
  if (n > 1) mantissa += "." + digits.substr(1);
  const std::string e = std::to_string(std::abs(exp10));
  return sign + mantissa + (exp10 < 0 ? "e-" : "e+") + (e.size() < 2 ? "0" : "") + e;
}

// A shape or grid as a Python tuple: (4, 5), (5,), ().
inline std::string py_tuple(c10::IntArrayRef values) {
  std::string out = "(";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + (values.size() == 1 ? ",)" : ")");
}

// A string as Python's repr writes a plain one: 'bogus'.
inline std::string py_str(c10::string_view s) {
  return "'" + std::string(s.data(), s.size()) + "'";
}

// A dtype as Python names it: torch.float32, torch.int64, ...
inline std::string py_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    case c10::ScalarType::Long: return "torch.int64";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Short: return "torch.int16";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Byte: return "torch.uint8";
    case c10::ScalarType::Bool: return "torch.bool";
    case c10::ScalarType::ComplexHalf: return "torch.complex32";
    case c10::ScalarType::ComplexFloat: return "torch.complex64";
    case c10::ScalarType::ComplexDouble: return "torch.complex128";
    case c10::ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case c10::ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    case c10::ScalarType::Float8_e4m3fnuz: return "torch.float8_e4m3fnuz";
    case c10::ScalarType::Float8_e5m2fnuz: return "torch.float8_e5m2fnuz";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// The same without "torch.": float32, int64, ... (how ops take a dtype by name, as a str).
inline std::string dtype_name(c10::ScalarType t) {
  return py_dtype(t).substr(sizeof("torch.") - 1);
}

}  // namespace ops
}  // namespace posenc
