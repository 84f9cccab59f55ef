// Typed dispatcher handles of the posenc ops, looked up once. (rope, rope_ and
// rope_position_bounds are called boxed, through RopeCall: rope/rope_call.h.)
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

using RopeFrequenciesSig = std::tuple<at::Tensor, double>(int64_t, double, c10::string_view,
                                                          at::ArrayRef<double>, int64_t,
                                                          at::IntArrayRef, c10::string_view);
using RopeGridPositionsSig = at::Tensor(at::IntArrayRef, int64_t, std::optional<at::Device>);

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

inline const c10::TypedOperatorHandle<RopeFrequenciesSig>& rope_frequencies_op() {
  static const auto handle = find_op<RopeFrequenciesSig>("posenc::rope_frequencies");
  return handle;
}
inline const c10::TypedOperatorHandle<RopeGridPositionsSig>& rope_grid_positions_op() {
  static const auto handle = find_op<RopeGridPositionsSig>("posenc::rope_grid_positions");
  return handle;
}

}  // namespace ops
}  // namespace posenc
