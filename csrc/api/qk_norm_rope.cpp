// posenc/qk_norm_rope.h: the C++ front end of the qk_norm_rope op, through the dispatcher.
#include "posenc/qk_norm_rope.h"

#include "api/rope_call_from_options.h"
#include "ops/qk_norm_rope/qk_norm_rope_call.h"

namespace posenc {

std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(const torch::Tensor& q, const torch::Tensor& k,
                                                      const torch::Tensor& q_weight,
                                                      const torch::Tensor& k_weight,
                                                      const QkNormRopeOptions& o) {
  ops::QkNormRopeCall c;
  c.rope = detail::make_rope_call(q, k, o.rope(), detail::rope_seq_len_argument(o.rope().scaling()));
  c.q_weight = q_weight;
  c.k_weight = k_weight;
  c.eps = o.eps();
  c.weight_offset = o.weight_offset();
  c.norm = ops::parse_qk_norm(o.norm());
  return ops::call_qk_norm_rope(c);
}

}  // namespace posenc
