// posenc/rope_append_kv.h: the C++ front end of the rope_append_kv ops (a boxed call through
// the dispatcher, so CPU or CUDA by the inputs' device).
#include "posenc/rope_append_kv.h"

#include "ops/rope_append_kv/rope_append_kv.h"

namespace posenc {
namespace {

ops::RopeAppendKvCall make_append_kv_call(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& k_cache,
                                const torch::Tensor& v_cache, const RopeAppendKvOptions& o) {
  ops::RopeAppendKvCall c;
  c.rope = detail::make_rope_call(q, k, o.rope(),
                                  detail::rope_seq_len_argument(o.rope().scaling(), o.rope().seq_len()));
  c.v = v;
  c.k_cache = k_cache;
  c.v_cache = v_cache;
  c.slot_mapping = o.slot_mapping();
  c.return_k = o.return_k();
  c.k_scale = o.k_scale();
  c.v_scale = o.v_scale();
  c.q_weight = o.q_weight();
  c.k_weight = o.k_weight();
  c.eps = o.eps();
  c.weight_offset = o.weight_offset();
  c.norm = ops::parse_qk_norm(o.norm());
  return c;
}

}  // namespace

RopeAppendKvOptions& RopeAppendKvOptions::k_scale(double scale) {
  k_scale_ = torch::tensor(static_cast<float>(scale), torch::kFloat);
  return *this;
}

RopeAppendKvOptions& RopeAppendKvOptions::v_scale(double scale) {
  v_scale_ = torch::tensor(static_cast<float>(scale), torch::kFloat);
  return *this;
}

std::tuple<torch::Tensor, torch::Tensor> rope_append_kv(const torch::Tensor& q,
                                                        const torch::Tensor& k,
                                                        const torch::Tensor& v,
                                                        const torch::Tensor& k_cache,
                                                        const torch::Tensor& v_cache,
                                                        const RopeAppendKvOptions& o) {
  return ops::call_rope_append_kv(make_append_kv_call(q, k, v, k_cache, v_cache, o));
}

void rope_append_kv_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const RopeAppendKvOptions& o) {
  ops::call_rope_append_kv_inplace(make_append_kv_call(q, k, v, k_cache, v_cache, o));
}

}  // namespace posenc
