// GoogleTest: posenc::LearnedPositionalEncoding and the C++ helpers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "posenc/posenc.h"

namespace {

TEST(LearnedPositionalEncodingModule, ParameterAndForward) {
  torch::manual_seed(0);
  posenc::LearnedPositionalEncoding m(posenc::LearnedPositionalEncodingOptions(16).max_len(300));
  ASSERT_EQ(m->pe.sizes(), (std::vector<int64_t>{1, 300, 16}));
  EXPECT_TRUE(m->pe.requires_grad());
  ASSERT_EQ(m->named_parameters().size(), 1u);
  EXPECT_LE(m->pe.abs().max().item<double>(), 0.04 + 1e-7);
  EXPECT_NEAR(m->pe.std().item<double>(), 0.02 * 0.8796, 1e-3);
  m->eval();
  auto x = torch::randn({2, 9, 16});
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(m(x), x + m->pe.slice(1, 0, 9)));
  EXPECT_TRUE(torch::equal(m(x, 20), x + m->pe.slice(1, 20, 29)));
}

TEST(LearnedPositionalEncodingModule, TableGradientIsBatchSumAndDeterministic) {
  posenc::LearnedPositionalEncoding m(
      posenc::LearnedPositionalEncodingOptions(24).max_len(40).dropout(0.2));
  m->train();
  auto x = torch::randn({6, 30, 24}, torch::requires_grad(true));
  auto pos = torch::randint(0, 5, {6, 30}, torch::kLong);  // heavy repetition
  auto g = torch::randn({6, 30, 24});
  std::vector<torch::Tensor> grads;
  for (int run = 0; run < 3; ++run) {
    m->pe.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    torch::manual_seed(3);
    auto y = m(x, 0, pos);
    y.backward(g);
    grads.push_back(m->pe.grad().clone());
    // The table gradient is the x gradient scattered into the rows used.
    auto want = torch::zeros({40, 24}, torch::kDouble)
                    .index_add_(0, pos.reshape(-1), x.grad().reshape({-1, 24}).to(torch::kDouble));
    EXPECT_TRUE(torch::allclose(m->pe.grad()[0].to(torch::kDouble), want, 1e-5, 1e-5));
  }
  EXPECT_TRUE(torch::equal(grads[0], grads[1]));
  EXPECT_TRUE(torch::equal(grads[0], grads[2]));
}

TEST(LearnedPositionalEncodingModule, LoadTableAndSaveLoad) {
  posenc::LearnedPositionalEncoding a(posenc::LearnedPositionalEncodingOptions(8).max_len(12));
  auto table = torch::randn({12, 8});
  a->load_table(table);
  EXPECT_TRUE(torch::equal(a->pe[0], table));
  EXPECT_THROW(a->load_table(torch::randn({13, 8})), c10::Error);
  const std::string path = ::testing::TempDir() + "posenc_learned.pt";
  torch::save(a, path);
  posenc::LearnedPositionalEncoding b(posenc::LearnedPositionalEncodingOptions(8).max_len(12));
  torch::load(b, path);
  std::remove(path.c_str());
  EXPECT_TRUE(torch::equal(a->pe, b->pe));
}

TEST(Helpers, MakePositions) {
  auto tokens = torch::tensor({5, 6, 1, 1, 1, 7, 8, 9}, torch::kLong).reshape({2, 4});
  auto want = torch::tensor({2, 3, 1, 1, 1, 2, 3, 4}, torch::kLong).reshape({2, 4});
  EXPECT_TRUE(torch::equal(posenc::make_positions(tokens, 1), want));
  EXPECT_THROW(posenc::make_positions(torch::rand({2, 3}), 1), c10::Error);
}

TEST(Helpers, Sinusoidal2dTableFollowsMaeLayout) {
  const int64_t h = 3, w = 5, dim = 16;
  auto t = posenc::sinusoidal_2d_table(h, w, dim, 10000.0, 1, torch::kDouble);
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{1 + h * w, dim}));
  EXPECT_EQ(t[0].abs().sum().item<double>(), 0.0);
  auto acc = t.accessor<double, 2>();
  for (int64_t r = 0; r < h; ++r) {
    for (int64_t c = 0; c < w; ++c) {
      for (int64_t i = 0; i < dim / 4; ++i) {
        const double omega = 1.0 / std::pow(10000.0, i / (dim / 4.0));
        const int64_t row = 1 + r * w + c;
        EXPECT_NEAR(acc[row][i], std::sin(c * omega), 1e-12);               // w: first half
        EXPECT_NEAR(acc[row][dim / 4 + i], std::cos(c * omega), 1e-12);
        EXPECT_NEAR(acc[row][dim / 2 + i], std::sin(r * omega), 1e-12);     // h: second half
        EXPECT_NEAR(acc[row][3 * dim / 4 + i], std::cos(r * omega), 1e-12);
      }
    }
  }
  EXPECT_THROW(posenc::sinusoidal_2d_table(4, 4, 10), c10::Error);
}

TEST(Helpers, ResamplePositionTable) {
  auto pe = torch::randn({1, 1 + 16, 8});
  auto out = posenc::resample_position_table(pe, 6, 3);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 1 + 18, 8}));
  EXPECT_TRUE(torch::equal(out.slice(1, 0, 1), pe.slice(1, 0, 1)));
  // Resampling to the same grid is the identity; a constant table stays constant.
  EXPECT_TRUE(torch::equal(posenc::resample_position_table(pe, 4, 4), pe));
  auto flat = torch::full({1, 17, 8}, 0.5);
  EXPECT_TRUE(torch::allclose(posenc::resample_position_table(flat, 7, 7), torch::full({1, 50, 8}, 0.5),
                              1e-6, 1e-6));
  EXPECT_THROW(posenc::resample_position_table(pe, 6, 6, 4, 5), c10::Error);
  EXPECT_THROW(posenc::resample_position_table(torch::randn({1, 20, 8}), 6, 6), c10::Error);
}

}  // namespace
