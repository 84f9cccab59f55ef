// Typed dispatcher handles of the posenc ops, looked up once.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace posenc {
namespace ops {

using AddPositionSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                                  const std::optional<at::Tensor>&, c10::SymInt, bool, double);
using AddPositionForwardSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::SymInt, bool,
    double);
using AddPositionBackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddPositionBackwardWithTableSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::SymInt, bool,
    double, c10::SymInt, bool);
using SinusoidalTableSig = at::Tensor(const at::Tensor&, c10::SymInt, double,
                                      std::optional<at::ScalarType>);

// rope and rope_ share their arguments; rope returns (q, k-or-empty), rope_ nothing.
#define POSENC_ROPE_ARGS                                                                      \
  const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,     \
      const std::optional<at::Tensor>&, c10::SymInt, const std::optional<at::Tensor>&, double, \
      c10::string_view, at::ArrayRef<double>, int64_t, int64_t, bool, c10::string_view, bool
using RopeSig = std::tuple<at::Tensor, at::Tensor>(POSENC_ROPE_ARGS);
using RopeInplaceSig = void(POSENC_ROPE_ARGS);
#undef POSENC_ROPE_ARGS
using RopeFrequenciesSig = std::tuple<at::Tensor, double>(int64_t, double, c10::string_view,
                                                          at::ArrayRef<double>, int64_t);
using RopePositionBoundsSig = std::tuple<int64_t, int64_t>(
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
    const std::optional<at::Tensor>&, c10::string_view);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Sig>();
}

// Each handle is looked up once, on first use (after the library has registered).
inline const c10::TypedOperatorHandle<AddPositionSig>& add_position_op() {
  static const auto handle = find_op<AddPositionSig>("posenc::add_position");
  return handle;
}
inline const c10::TypedOperatorHandle<AddPositionForwardSig>& add_position_forward_op() {
  static const auto handle = find_op<AddPositionForwardSig>("posenc::add_position_forward");
  return handle;
}
inline const c10::TypedOperatorHandle<AddPositionBackwardSig>& add_position_backward_op() {
  static const auto handle = find_op<AddPositionBackwardSig>("posenc::add_position_backward");
  return handle;
}
inline const c10::TypedOperatorHandle<AddPositionBackwardWithTableSig>&
add_position_backward_with_table_op() {
  static const auto handle = find_op<AddPositionBackwardWithTableSig>(
      "posenc::add_position_backward_with_table");
  return handle;
}
inline const c10::TypedOperatorHandle<SinusoidalTableSig>& sinusoidal_table_op() {
  static const auto handle = find_op<SinusoidalTableSig>("posenc::sinusoidal_table");
  return handle;
}

inline const c10::TypedOperatorHandle<RopeSig>& rope_op() {
  static const auto handle = find_op<RopeSig>("posenc::rope");
  return handle;
}
inline const c10::TypedOperatorHandle<RopeInplaceSig>& rope_inplace_op() {
  static const auto handle = find_op<RopeInplaceSig>("posenc::rope_");
  return handle;
}
inline const c10::TypedOperatorHandle<RopeFrequenciesSig>& rope_frequencies_op() {
  static const auto handle = find_op<RopeFrequenciesSig>("posenc::rope_frequencies");
  return handle;
}
inline const c10::TypedOperatorHandle<RopePositionBoundsSig>& rope_position_bounds_op() {
  static const auto handle = find_op<RopePositionBoundsSig>("posenc::rope_position_bounds");
  return handle;
}

}  // namespace ops
}  // namespace posenc
