// GoogleTest: posenc::PositionalEncoding against a C++ reference, gradients, save/load.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "posenc/math/philox.h"
#include "posenc/posenc.h"

namespace {

// The classic float64 construction written out: sin at even, cos at odd columns.
torch::Tensor reference_pe(int64_t max_len, int64_t d, double base = 10000.0) {
  auto pe = torch::zeros({max_len, d}, torch::kDouble);
  auto acc = pe.accessor<double, 2>();
  for (int64_t pos = 0; pos < max_len; ++pos) {
    for (int64_t j = 0; j < d; ++j) {
      const double angle = pos * std::exp(-static_cast<double>(j - j % 2) * std::log(base) / d);
      acc[pos][j] = j % 2 == 0 ? std::sin(angle) : std::cos(angle);
    }
  }
  return pe.unsqueeze(0);
}

TEST(PositionalEncodingModule, BufferIsTheCorrectlyRoundedTable) {
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(33).max_len(300));
  ASSERT_EQ(pe->pe.sizes(), (std::vector<int64_t>{1, 300, 33}));
  EXPECT_EQ(pe->pe.scalar_type(), torch::kFloat);
  auto err = (pe->pe.to(torch::kDouble) - reference_pe(300, 33)).abs().max().item<double>();
  EXPECT_LE(err, std::ldexp(1.0, -24));
  auto named = pe->named_buffers();
  ASSERT_EQ(named.size(), 1u);
  EXPECT_TRUE(named.contains("pe"));
}

TEST(PositionalEncodingModule, ResetAgainRebuildsTheTableFromEditedOptions) {
  // torch::nn's reset(): options edited, then reset() (register_buffer refused the name twice).
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(8).max_len(10));
  const torch::Tensor before = pe->pe;
  pe->options.max_len(20).d_model(6);
  pe->reset();
  ASSERT_EQ(pe->pe.sizes(), (std::vector<int64_t>{1, 20, 6}));
  EXPECT_LE((pe->pe.to(torch::kDouble) - reference_pe(20, 6)).abs().max().item<double>(), std::ldexp(1.0, -24));
  auto named = pe->named_buffers();
  ASSERT_EQ(named.size(), 1u);
  EXPECT_TRUE(named["pe"].is_same(pe->pe));
  EXPECT_TRUE(before.is_same(pe->pe));  // the registered buffer, its data replaced
  pe->options.dropout(0.0);
  auto x = torch::randn({2, 15, 6});
  EXPECT_TRUE(torch::equal(pe->forward(x), x + pe->pe.slice(1, 0, 15)));

  posenc::LearnedPositionalEncoding lpe(posenc::LearnedPositionalEncodingOptions(8).max_len(10));
  lpe->options.max_len(20);
  lpe->reset();
  ASSERT_EQ(lpe->pe.sizes(), (std::vector<int64_t>{1, 20, 8}));
  EXPECT_TRUE(lpe->pe.requires_grad());
  auto params = lpe->named_parameters();
  ASSERT_EQ(params.size(), 1u);
  EXPECT_TRUE(params["pe"].is_same(lpe->pe));
  EXPECT_GT(lpe->pe.abs().max().item<double>(), 0.0);  // initialised again
  // A module in double keeps its dtype through reset().
  lpe->to(torch::kDouble);
  lpe->reset();
  EXPECT_EQ(lpe->pe.scalar_type(), torch::kDouble);
}

// clone() copies the module, clears its registry and calls reset(): the copy registers its
// own table; the original keeps its (here edited / trained) values, dtype and registration.
template <typename Holder>
void expect_independent_clone(Holder& m, double value) {
  {
    torch::NoGradGuard no_grad;
    m->pe.fill_(value);
  }
  auto copy = std::dynamic_pointer_cast<typename Holder::ContainedType>(m->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(torch::equal(copy->pe, m->pe));
  EXPECT_FALSE(copy->pe.is_same(m->pe));
  EXPECT_EQ(m->pe.min().template item<double>(), value);
  EXPECT_EQ(copy->pe.scalar_type(), m->pe.scalar_type());
  EXPECT_EQ(copy->pe.requires_grad(), m->pe.requires_grad());
  auto params = copy->named_parameters(), buffers = copy->named_buffers();
  ASSERT_EQ(params.size() + buffers.size(), 1u);
  EXPECT_TRUE((params.size() ? params["pe"] : buffers["pe"]).is_same(copy->pe));
}

TEST(PositionalEncodingModule, CloneCopiesTheTableAndLeavesTheOriginalAlone) {
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(8).max_len(10));
  pe->to(torch::kDouble);
  expect_independent_clone(pe, 7.0);
  EXPECT_EQ(pe->pe.scalar_type(), torch::kDouble);
  posenc::LearnedPositionalEncoding lpe(posenc::LearnedPositionalEncodingOptions(8).max_len(10));
  expect_independent_clone(lpe, 42.0);  // trained values kept
  EXPECT_TRUE(lpe->pe.requires_grad());
}

TEST(PositionalEncodingModule, ForwardEvalAddsRows) {
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(16).max_len(64).dropout(0.5));
  pe->eval();
  auto x = torch::randn({2, 10, 16});
  EXPECT_TRUE(torch::allclose(pe->forward(x), x + pe->pe.slice(1, 0, 10), 0, 0));
  EXPECT_TRUE(torch::allclose(pe->forward(x, 5), x + pe->pe.slice(1, 5, 15), 0, 0));
  auto pos = torch::randint(0, 64, {2, 10}, torch::kLong);
  auto want = x + pe->pe[0].index_select(0, pos.reshape(-1)).reshape({2, 10, 16});
  EXPECT_TRUE(torch::allclose(pe->forward(x, 0, pos), want, 0, 0));
  EXPECT_TRUE(torch::allclose(pe(x), x + pe->pe.slice(1, 0, 10), 0, 0));  // holder operator()
  EXPECT_THROW(pe->forward(x, 60), c10::Error);
}

TEST(PositionalEncodingModule, TrainingGradientsAreMaskTimesScale) {
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(8).max_len(32).dropout(0.25));
  pe->train();
  auto x = torch::randn({3, 7, 8}, torch::requires_grad(true));
  auto y = pe->forward(x);
  y.sum().backward();
  auto kept = y.detach() != 0;
  auto expected = kept.to(torch::kFloat) * static_cast<float>(1.0 / 0.75);
  EXPECT_TRUE(torch::allclose(x.grad(), expected, 0, 0));
}

TEST(PositionalEncodingModule, BaseOptionBuildsTheTableWithThatBase) {
  for (int64_t d : {20, 21}) {
    posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(d).max_len(200).base(500.0));
    ASSERT_EQ(pe->pe.sizes(), (std::vector<int64_t>{1, 200, d}));
    EXPECT_EQ(pe->pe.scalar_type(), torch::kFloat);
    const auto exact = reference_pe(200, d, 500.0);
    // Rounded once from float64: within half an ulp of float32 at 1 (plus float64 slack).
    const auto err = (pe->pe.to(torch::kDouble) - exact).abs().max().item<double>();
    EXPECT_LE(err, std::ldexp(1.0, -25) + 1e-12) << "d=" << d;
    // The base really is used: the default-base table is far from it.
    const auto other = (reference_pe(200, d) - exact).abs().max().item<double>();
    EXPECT_GT(other, 0.1);
    // The forward adds rows of that table.
    pe->eval();
    auto x = torch::randn({2, 7, d});
    EXPECT_TRUE(torch::equal(pe->forward(x, 3), x + pe->pe.slice(1, 3, 10)));
  }
  for (double bad : {0.0, -2.0, 0.5, 1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    EXPECT_THROW(posenc::PositionalEncoding(posenc::PositionalEncodingOptions(8).base(bad)),
                 c10::ValueError)
        << "base=" << bad;
  }
}

TEST(PositionalEncodingModule, SequenceFirstLayoutEvalAddsRows) {
  posenc::PositionalEncoding pe(
      posenc::PositionalEncodingOptions(16).max_len(64).dropout(0.5).batch_first(false));
  pe->eval();
  auto x = torch::randn({9, 3, 16});  // (seq, batch, d_model)
  auto rows = [&](int64_t start) { return pe->pe[0].slice(0, start, start + 9).unsqueeze(1); };
  EXPECT_TRUE(torch::equal(pe->forward(x), x + rows(0)));
  EXPECT_TRUE(torch::equal(pe->forward(x, 11), x + rows(11)));
  auto pos = torch::randint(0, 64, {9}, torch::kLong);
  EXPECT_TRUE(torch::equal(pe->forward(x, 0, pos), x + pe->pe[0].index_select(0, pos).unsqueeze(1)));
  // Per-(batch, seq) positions are given as (batch, seq) in either layout.
  auto pos2 = torch::randint(0, 64, {3, 9}, torch::kLong);
  auto want2 = x + pe->pe[0].index_select(0, pos2.reshape(-1)).reshape({3, 9, 16}).transpose(0, 1);
  EXPECT_TRUE(torch::equal(pe->forward(x, 0, pos2), want2));
  // The sequence is dimension 0: 60 + 9 rows exceed max_len=64.
  EXPECT_THROW(pe->forward(x, 60), c10::Error);
}

TEST(PositionalEncodingModule, SequenceFirstLayoutTrainingGradientsAreMaskTimesScale) {
  const double p = 0.3;
  posenc::PositionalEncoding pe(
      posenc::PositionalEncodingOptions(8).max_len(32).dropout(p).batch_first(false));
  pe->train();
  auto x = torch::randn({11, 4, 8}, torch::requires_grad(true));  // (seq, batch, d_model)
  auto y = pe->forward(x, 5);
  auto kept = y.detach() != 0;
  const float scale = posenc::math::dropout_scale<float>(1.0 - p);  // nn.Dropout's float32 factor
  // Survivors are exactly (x + pe row) * scale, with row = 5 + seq index.
  auto summed = x.detach() + pe->pe[0].slice(0, 5, 16).unsqueeze(1);
  auto want = summed * scale;
  EXPECT_TRUE(torch::equal(y.detach().masked_select(kept), want.masked_select(kept)));
  const double frac = 1.0 - kept.to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(frac, p, 4 * std::sqrt(p * (1 - p) / y.numel()));
  auto g = torch::randn({11, 4, 8});
  y.backward(g);
  auto expected = torch::where(kept, g * scale, torch::zeros_like(g));
  EXPECT_TRUE(torch::equal(x.grad(), expected));
}

TEST(PositionalEncodingModule, SaveLoadRoundTrip) {
  posenc::PositionalEncoding a(posenc::PositionalEncodingOptions(12).max_len(20));
  a->pe.mul_(3.0);  // an edited table must survive the round trip
  const std::string path = ::testing::TempDir() + "posenc_module.pt";
  torch::save(a, path);
  posenc::PositionalEncoding b(posenc::PositionalEncodingOptions(12).max_len(20));
  torch::load(b, path);
  std::remove(path.c_str());
  EXPECT_TRUE(torch::equal(a->pe, b->pe));
}

// An archive of another max_len or d_model: refused (Python's load_state_dict refuses the
// same), the module left as it was; LibTorch's own load took it, leaving a 64-row table under
// options saying 32.
TEST(PositionalEncodingModule, LoadRefusesAnArchiveOfOtherShapesAndKeepsTheTable) {
  const std::string path = ::testing::TempDir() + "posenc_module_64.pt";
  torch::save(posenc::PositionalEncoding(posenc::PositionalEncodingOptions(16).max_len(64)), path);
  for (auto options : {posenc::PositionalEncodingOptions(16).max_len(32),
                       posenc::PositionalEncodingOptions(8).max_len(64)}) {
    posenc::PositionalEncoding b(options);
    const auto table = b->pe.clone();
    try {
      torch::load(b, path);
      ADD_FAILURE() << "a wrongly sized archive was loaded";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("size mismatch for pe: copying a tensor with shape [1, 64, 16]"),
                std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(b->pe, table));
    EXPECT_EQ(b->named_buffers()["pe"].data_ptr(), b->pe.data_ptr());
    b->eval();
    EXPECT_EQ(b(torch::zeros({1, 3, options.d_model()})).size(2), options.d_model());
  }
  std::remove(path.c_str());
}

// An archive of another dtype is cast into the module's tensors, as Python's load_state_dict
// copies (LibTorch's load set_ the module's tensor to the archive's storage: a float64 table
// loaded into a float32 module was read as float32 bytes, garbage, and a half one gave NaN).
TEST(PositionalEncodingModule, LoadCastsAnArchiveOfAnotherDtype) {
  const std::string path = ::testing::TempDir() + "posenc_module_f64.pt";
  posenc::PositionalEncoding wide(posenc::PositionalEncodingOptions(4).max_len(6));
  wide->to(torch::kDouble);
  wide->pe.mul_(1.0 + 1e-9);  // not a float32 value: the cast must round it
  torch::save(wide, path);
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    posenc::PositionalEncoding b(posenc::PositionalEncodingOptions(4).max_len(6));
    b->to(dtype);
    const auto* storage = b->pe.data_ptr();
    torch::load(b, path);
    EXPECT_EQ(b->pe.scalar_type(), dtype);
    EXPECT_TRUE(torch::equal(b->pe, wide->pe.to(dtype)));
    EXPECT_EQ(b->pe.data_ptr(), storage);  // copied into the module's own tensor
    EXPECT_EQ(b->named_buffers()["pe"].data_ptr(), storage);
  }
  std::remove(path.c_str());
}

// reset() of a float64 module writes the float64 table (it wrote float32 values, widened).
TEST(PositionalEncodingModule, ResetOfAFloat64ModuleIsTheFloat64Table) {
  posenc::PositionalEncoding m(posenc::PositionalEncodingOptions(12).max_len(40));
  EXPECT_EQ(m->pe.scalar_type(), torch::kFloat);
  m->to(torch::kDouble);
  m->reset();
  const auto want = posenc::sinusoidal_table(torch::arange(40, torch::kLong), 12, 10000.0, torch::kDouble);
  EXPECT_EQ(m->pe.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(m->pe[0], want));
}

TEST(PositionalEncodingModule, RejectsBadOptions) {
  EXPECT_THROW(posenc::PositionalEncoding(posenc::PositionalEncodingOptions(0)), c10::Error);
  EXPECT_THROW(posenc::PositionalEncoding(posenc::PositionalEncodingOptions(8).max_len(0)),
               c10::Error);
  EXPECT_THROW(posenc::PositionalEncoding(posenc::PositionalEncodingOptions(8).dropout(-0.1)),
               c10::Error);
}

// options.dropout() is read at each call (as Python's module.dropout.p) and checked in eval
// mode too, as nn.Dropout checks p: an edited 5.0 was accepted until the module trained.
TEST(PositionalEncodingModule, AnEditedDropoutIsCheckedInEvalModeToo) {
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(8).max_len(16));
  posenc::LearnedPositionalEncoding learned(posenc::LearnedPositionalEncodingOptions(8).max_len(16));
  pe->eval();
  learned->eval();
  const auto x = torch::randn({2, 3, 8});
  pe->options.dropout(5.0);
  learned->options.dropout(-1.0);
  EXPECT_THROW(pe(x), c10::ValueError);
  EXPECT_THROW(learned(x), c10::ValueError);
  pe->options.dropout(0.5);  // in eval mode: no dropout, the rows added
  EXPECT_TRUE(torch::equal(pe(x), x + pe->pe.slice(1, 0, 3)));
}

}  // namespace
