// posenc/rope_shift_kv.h: the C++ front end of the rope_shift_kv_ op (a boxed call through the
// dispatcher, so CPU or CUDA by the cache's device).
#include "posenc/rope_shift_kv.h"

#include "ops/common/op_handles.h"
#include "ops/rope_shift_kv/rope_shift_kv.h"

namespace posenc {

RopeShiftKvOptions& RopeShiftKvOptions::k_scale(double scale) {
  k_scale_ = torch::tensor(static_cast<float>(scale), torch::kFloat);
  return *this;
}

torch::Tensor rope_shift_kv_(const torch::Tensor& k_cache, const torch::Tensor& from_positions,
                             const torch::Tensor& to_positions, const RopeShiftKvOptions& o) {
  const ApplyRopeOptions& r = o.rope();
  TORCH_CHECK_VALUE(!ops::optional_tensor(r.positions()) && !ops::optional_tensor(r.offsets()) && r.offset() == 0 &&
                        !ops::optional_tensor(r.cu_seqlens()) && !r.inverse() && !r.seq_len().has_value(),
                    "posenc: rope_shift_kv_: options.rope() holds the configuration only; pass the "
                    "positions as from_positions and to_positions, the lengths as from_seq_len and "
                    "to_seq_len (got positions, offset(s), cu_seqlens, seq_len or inverse in it)");
  ops::RopeShiftKvCall c;
  c.config = detail::make_rope_call(k_cache, std::nullopt, o.rope(), 0);
  c.k_cache = k_cache;
  c.from_positions = from_positions;
  c.to_positions = to_positions;
  c.rows = o.rows();
  c.slot_mapping = o.slot_mapping();
  c.k_scale = o.k_scale();
  if (o.from_seq_len().has_value()) c.from_seq_len = c10::SymInt(*o.from_seq_len());
  if (o.to_seq_len().has_value()) c.to_seq_len = c10::SymInt(*o.to_seq_len());
  ops::call_rope_shift_kv(c);
  return k_cache;
}

}  // namespace posenc
