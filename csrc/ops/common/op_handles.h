// Typed dispatcher handles of the posenc ops, looked up once. (rope, rope_ and
// rope_position_bounds are called boxed, through RopeCall: rope/rope_call.h.)
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <utility>

namespace posenc {
namespace ops {

// An optional tensor argument as the C++ API reads it (and the KV-cache ops their optional
// arguments on the stack): absent when None or undefined (a C++ caller's torch::Tensor(),
// which ATen's functions read as absent too; given on, it showed up in messages as shape [0]
// and dtype UNKNOWN_SCALAR). RopeCall reads its optional tensors so too; q is refused by name,
// and the ops that need k refuse its absence where they pop their call. (Defined in
// rope_call.cpp.)
std::optional<at::Tensor> optional_tensor(const c10::IValue& v);
std::optional<at::Tensor> optional_tensor(const std::optional<at::Tensor>& t);
c10::IValue optional_tensor_ivalue(const std::optional<at::Tensor>& t);

// The kernel F registered so that its optional tensor arguments arrive through
// optional_tensor (undefined: absent), as the boxed ops read theirs: every kernel of a typed
// op with a `Tensor?` argument registers as absent_if_undefined<&kernel> (a direct dispatcher
// call from C++ may pass torch::Tensor() there; the kernels test has_value()).
namespace detail {
template <typename T>
T&& absent_if_undefined_arg(T&& v) { return std::forward<T>(v); }
inline std::optional<at::Tensor> absent_if_undefined_arg(const std::optional<at::Tensor>& t) {
  return optional_tensor(t);
}
template <auto F>
struct AbsentIfUndefined;
template <typename R, typename... Args, R (*F)(Args...)>
struct AbsentIfUndefined<F> {
  static R call(Args... args) { return F(absent_if_undefined_arg(std::forward<Args>(args))...); }
};
}  // namespace detail
template <auto F>
constexpr auto absent_if_undefined = &detail::AbsentIfUndefined<F>::call;

using AddPositionSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                                  const std::optional<at::Tensor>&, c10::SymInt, bool, double);
using AddPositionForwardSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::SymInt, bool,
    double, bool);
using AddPositionBackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddPositionBackwardWithTableSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::SymInt, bool,
    double, c10::SymInt, bool, std::optional<at::ScalarType>);
using SinusoidalTableSig = at::Tensor(const at::Tensor&, c10::SymInt, double, c10::string_view);

// The helpers (ops/helpers/*.cpp) and the add-position modules' range check.
using MakePositionsSig = at::Tensor(const at::Tensor&, int64_t, c10::SymInt);
using Sinusoidal2dTableSig = at::Tensor(int64_t, int64_t, int64_t, double, int64_t,
                                        std::optional<at::ScalarType>, std::optional<at::Device>,
                                        std::optional<double>, double);
using ResamplePositionTableSig = at::Tensor(const at::Tensor&, at::IntArrayRef,
                                            at::OptionalIntArrayRef, int64_t, c10::string_view,
                                            bool);
using TimestepEmbeddingSig = at::Tensor(const at::Tensor&, int64_t, double, bool, double, double);
using PositionBoundsSig = std::tuple<int64_t, int64_t>(const at::Tensor&, std::optional<int64_t>);

using RopeFrequenciesSig = std::tuple<at::Tensor, double>(int64_t, double, c10::string_view,
                                                          at::ArrayRef<double>, int64_t,
                                                          at::IntArrayRef, c10::string_view);
using RopeGridPositionsSig = at::Tensor(at::IntArrayRef, int64_t, std::optional<at::Device>);

// An op's handle for boxed calls (the Call structs' push / pop); callers keep it in a
// function-local static, looked up on first use.
inline c10::OperatorHandle find_boxed_op(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

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

inline const c10::TypedOperatorHandle<MakePositionsSig>& make_positions_op() {
  static const auto handle = find_op<MakePositionsSig>("posenc::make_positions");
  return handle;
}
inline const c10::TypedOperatorHandle<Sinusoidal2dTableSig>& sinusoidal_2d_table_op() {
  static const auto handle = find_op<Sinusoidal2dTableSig>("posenc::sinusoidal_2d_table");
  return handle;
}
inline const c10::TypedOperatorHandle<ResamplePositionTableSig>& resample_position_table_op() {
  static const auto handle = find_op<ResamplePositionTableSig>("posenc::resample_position_table");
  return handle;
}
inline const c10::TypedOperatorHandle<TimestepEmbeddingSig>& timestep_embedding_op() {
  static const auto handle = find_op<TimestepEmbeddingSig>("posenc::timestep_embedding");
  return handle;
}
inline const c10::TypedOperatorHandle<PositionBoundsSig>& position_bounds_op() {
  static const auto handle = find_op<PositionBoundsSig>("posenc::position_bounds");
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

using ApplyRopeCosSinSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    c10::string_view, bool, bool);
inline const c10::TypedOperatorHandle<ApplyRopeCosSinSig>& apply_rope_cos_sin_op() {
  static const auto handle = find_op<ApplyRopeCosSinSig>("posenc::apply_rope_cos_sin");
  return handle;
}

}  // namespace ops
}  // namespace posenc
