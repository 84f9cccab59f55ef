// GoogleTest: posenc::qk_norm_rope (the C++ front end of the fused QK-norm + RoPE op)
// against RMSNorm written with ATen ops followed by posenc::apply_rope, and its gradients
// (C++ autograd) against autograd through that composition.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "posenc/posenc.h"

namespace {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, double offset,
                       bool hidden) {
  const auto x64 = x.to(torch::kFloat64);
  const auto ms = hidden ? x64.square().mean({-2, -1}, true) : x64.square().mean(-1, true);
  auto w64 = w.to(torch::kFloat64) + offset;
  if (hidden) w64 = w64.view({x.size(-2), x.size(-1)});
  return x64 * torch::rsqrt(ms + eps) * w64;
}

TEST(QkNormRope, MatchesNormThenApplyRopeWithGradients) {
  torch::manual_seed(0);
  for (const bool hidden : {false, true}) {
    const int64_t B = 2, S = 5, Hq = 4, Hk = 2, D = 16;
    const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
    auto q = torch::randn({B, S, Hq, D}, opts).requires_grad_(true);
    auto k = torch::randn({B, S, Hk, D}, opts).requires_grad_(true);
    auto wq = (torch::rand({hidden ? Hq * D : D}, opts) + 0.5).requires_grad_(true);
    auto wk = (torch::rand({hidden ? Hk * D : D}, opts) + 0.5).requires_grad_(true);
    const auto rope = posenc::ApplyRopeOptions().offset(3).rotary_dim(8).base(500.0);
    const auto o = posenc::QkNormRopeOptions()
                       .eps(1e-5)
                       .weight_offset(1.0)
                       .norm(hidden ? "hidden" : "head")
                       .rope(rope);
    auto [oq, ok] = posenc::qk_norm_rope(q, k, wq, wk, o);
    auto [rq, rk] = posenc::apply_rope(rms_norm(q, wq, 1e-5, 1.0, hidden),
                                       rms_norm(k, wk, 1e-5, 1.0, hidden), rope);
    EXPECT_TRUE(torch::allclose(oq, rq, 1e-10, 1e-10));
    EXPECT_TRUE(torch::allclose(ok, rk, 1e-10, 1e-10));
    const auto gq = torch::randn_like(oq), gk = torch::randn_like(ok);
    const auto got = torch::autograd::grad({oq, ok}, {q, k, wq, wk}, {gq, gk});
    const auto want = torch::autograd::grad({rq, rk}, {q, k, wq, wk}, {gq, gk});
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-9, 1e-9)) << "input " << i;
    }
  }
}

TEST(QkNormRope, BadNormNamesTheArgument) {
  const auto q = torch::randn({1, 2, 2, 8}), k = torch::randn({1, 2, 1, 8}), w = torch::ones({8});
  try {
    posenc::qk_norm_rope(q, k, w, w, posenc::QkNormRopeOptions().norm("layer"));
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown norm 'layer'"), std::string::npos);
  }
  EXPECT_THROW(posenc::qk_norm_rope(q, k, torch::ones({7}), w), c10::ValueError);
}

}  // namespace
