// posenc/qk_norm_rope.h: the C++ front end of the qk_norm_rope op, through the dispatcher.
#include "posenc/qk_norm_rope.h"

#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <cmath>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

#include "module_state.h"
#include "ops/common/op_handles.h"
#include "ops/qk_norm_rope/qk_norm_rope.h"

namespace posenc {

namespace detail {
struct ParsedQkNormRope {
  ops::QkNormRopeCall call;  // every setting; the tensors and positions unset
  RopeScaling scaling;       // what decides a given seq_len's argument (rope_seq_len_argument)
  int64_t head_dim;          // the heads the frequencies and the rotary width were set up for
};
}  // namespace detail

namespace {

ops::QkNormRopeCall make_qk_norm_rope_call(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& q_weight, const torch::Tensor& k_weight,
                              const QkNormRopeOptions& o) {
  ops::QkNormRopeCall c;
  c.rope = detail::make_rope_call(q, k, o.rope(),
                                  detail::rope_seq_len_argument(o.rope().scaling(), o.rope().seq_len()));
  c.q_weight = q_weight;
  c.k_weight = k_weight;
  c.eps = o.eps();
  c.weight_offset = o.weight_offset();
  c.norm = ops::parse_qk_norm(o.norm());
  return c;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope(const torch::Tensor& q, const torch::Tensor& k,
                                                      const torch::Tensor& q_weight,
                                                      const torch::Tensor& k_weight,
                                                      const QkNormRopeOptions& o) {
  return ops::call_qk_norm_rope(make_qk_norm_rope_call(q, k, q_weight, k_weight, o));
}

void qk_norm_rope_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& q_weight,
                   const torch::Tensor& k_weight, const QkNormRopeOptions& o) {
  ops::call_qk_norm_rope_inplace(make_qk_norm_rope_call(q, k, q_weight, k_weight, o));
}

void QkNormWeightImpl::reset() {
  // The default dtype (torch::full infers it from a double), as Python's QKNormRotary.
  detail::register_or_replace(*this, "weight", weight, torch::full({size}, init), /*buffer=*/false);
}

void QkNormWeightImpl::pretty_print(std::ostream& stream) const { stream << "posenc::QkNormWeight(" << size << ")"; }

void QkNormWeightImpl::load(torch::serialize::InputArchive& archive) { detail::load_same_shapes(*this, archive); }

void QKNormRotaryImpl::load(torch::serialize::InputArchive& archive) { detail::load_same_shapes(*this, archive); }

QKNormRotaryImpl::QKNormRotaryImpl(const QKNormRotaryOptions& options_) : options(options_) {
  reset();
}

void QKNormRotaryImpl::reset() {
  const auto& o = options;
  TORCH_CHECK_VALUE(o.head_dim() > 0, "QKNormRotary: expected head_dim > 0, got ", o.head_dim());
  ops::parse_qk_norm(o.norm());  // names norm and what it may be
  const bool hidden = o.norm() == "hidden";
  for (auto [name, count] : {std::pair<const char*, std::optional<int64_t>>{"num_heads", o.num_heads()},
                              {"num_kv_heads", o.num_kv_heads()}}) {
    // Checked when given, also where norm="head" does not read them (a typo is not ignored),
    // as Python's QKNormRotary.
    TORCH_CHECK_VALUE(!count.has_value() || *count > 0, "QKNormRotary: expected ", name, " > 0, got ", *count);
    TORCH_CHECK_VALUE(!hidden || count.value_or(0) > 0,
                      "QKNormRotary: norm='hidden' normalises each token's whole projection: expected ", name,
                      " > 0 (the weights have num_heads * head_dim and num_kv_heads * head_dim values), got ",
                      count.has_value() ? std::to_string(*count) : std::string("none"));
  }
  TORCH_CHECK_VALUE(std::isfinite(o.weight_offset()), "QKNormRotary: expected a finite weight_offset, got ",
                    o.weight_offset());
  TORCH_CHECK_VALUE(std::isfinite(o.eps()) && o.eps() > 0.0,
                    "QKNormRotary: expected eps > 0 (added to the mean square), got ", o.eps());
  int64_t lq = o.head_dim(), lk = o.head_dim();
  // The weights' lengths (a product that wrapped gave a module of the wrong size, silently).
  TORCH_CHECK_VALUE(!hidden || (!c10::mul_overflows(*o.num_heads(), o.head_dim(), &lq) &&
                                !c10::mul_overflows(*o.num_kv_heads(), o.head_dim(), &lk)),
                    "QKNormRotary: expected num_heads * head_dim and num_kv_heads * head_dim to fit in int64, "
                    "got num_heads=", o.num_heads().value_or(0), ", num_kv_heads=", o.num_kv_heads().value_or(0),
                    ", head_dim=", o.head_dim());
  const ApplyRopeOptions& r = o.rope();
  TORCH_CHECK_VALUE(!ops::optional_tensor(r.positions()) && !ops::optional_tensor(r.offsets()) && r.offset() == 0 &&
                        !ops::optional_tensor(r.cu_seqlens()) && !r.seq_len().has_value(),
                    "QKNormRotary: options.rope() holds the configuration only; pass positions, "
                    "offset(s), cu_seqlens or seq_len with each call (forward's RopePositions)");
  const double init = 1.0 - o.weight_offset();  // effective weights start at 1
  // The norm weights: registered by the first reset() (the constructor's, or a clone's, whose
  // children were cleared); a later reset() keeps them (they may be trained) unless their
  // size changed (then new ones, initialised), as it re-parses the options.
  for (auto [name, member, size] : {std::tuple<const char*, QkNormWeight*, int64_t>{"q_norm", &q_norm, lq},
                                    {"k_norm", &k_norm, lk}}) {
    if (named_children().find(name) == nullptr) {
      *member = register_module(name, QkNormWeight(size, init));
    } else if ((*member)->size != size || (*member)->weight.numel() != size) {
      // On the old weight's device and in its dtype (a module moved by to() stays there).
      const auto like = (*member)->weight.options();
      QkNormWeight fresh(size, init);
      fresh->to(like.device(), like.dtype().toScalarType());
      *member = replace_module(name, fresh);
    }
  }
  QkNormRopeOptions parsed;
  parsed.eps(o.eps()).weight_offset(o.weight_offset()).norm(o.norm()).rope(o.rope());
  ops::QkNormRopeCall call = make_qk_norm_rope_call(torch::Tensor(), torch::Tensor(), torch::Tensor(),
                                       torch::Tensor(), parsed);
  call.rope.k = std::nullopt;
  // The op checks the RoPE settings now, for heads of head_dim features (an empty q).
  ops::RopeCall probe = call.rope;
  probe.positions = probe.offsets = std::nullopt;
  if (probe.layout == ops::RopeLayout::kTHD) {
    probe.q = at::empty({0, 1, o.head_dim()});
    probe.cu_seqlens = at::zeros({1}, at::kLong);
  } else {
    probe.q = at::empty({0, 0, 1, o.head_dim()});
  }
  ops::call_rope_rotary_width(probe);
  parsed_ = std::make_shared<const detail::ParsedQkNormRope>(
      detail::ParsedQkNormRope{std::move(call), r.scaling(), o.head_dim()});
}

void QKNormRotaryImpl::pretty_print(std::ostream& stream) const {
  stream << "posenc::QKNormRotary(head_dim=" << options.head_dim() << ", eps=" << options.eps()
         << ", weight_offset=" << options.weight_offset() << ", norm=" << options.norm() << ")";
}

std::tuple<torch::Tensor, torch::Tensor> QKNormRotaryImpl::forward(const torch::Tensor& q,
                                                                   const torch::Tensor& k,
                                                                   const RopePositions& where) {
  const detail::ParsedQkNormRope& parsed = *parsed_;  // the options, parsed once by reset()
  // q's and k's head_dim is the module's: norm="hidden" weights (heads * head_dim values)
  // also fit heads of another width, which would turn with other frequencies and pairs.
  // (An undefined or 0-d tensor: the op's message.)
  const auto fits = [&](const torch::Tensor& t) {
    return !t.defined() || t.dim() == 0 || t.size(-1) == parsed.head_dim;
  };
  TORCH_CHECK_VALUE(fits(q) && fits(k),
                    "QKNormRotary: expected q and k with head_dim ", parsed.head_dim,
                    " (the module's head_dim), got shapes ", q.sizes(), " and ", k.sizes());
  ops::QkNormRopeCall call = parsed.call;
  // The norm's settings as the options hold them now (the op checks them), as Python's module
  // reads its eps, weight_offset and norm at each call.
  call.eps = options.eps();
  call.weight_offset = options.weight_offset();
  call.norm = ops::parse_qk_norm(options.norm());
  call.rope.q = q;
  call.rope.k = k;
  detail::set_rope_positions(call.rope, where);
  if (where.seq_len().has_value()) {
    call.rope.seq_len = detail::rope_seq_len_argument(parsed.scaling, where.seq_len());
  }
  call.q_weight = q_norm->weight;
  call.k_weight = k_norm->weight;
  return ops::call_qk_norm_rope(call);
}

}  // namespace posenc
