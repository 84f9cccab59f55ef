// GoogleTest: posenc::LearnedPositionalEncoding and the C++ helpers.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/common/py_format.h"
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

// padding_idx as torch::nn::Embedding's (fairseq, RoBERTa): the row starts at zero and gets
// no gradient; forward adds it as it is; a negative one counts from the end; out of range
// throws (c10::ValueError). An edit of options.padding_idx is read at the next call, as
// Python's module reads its padding_idx (it followed reset() alone, which redraws the table:
// an edit without it was ignored silently).
TEST(LearnedPositionalEncodingModule, PaddingIdxIsEmbeddings) {
  torch::manual_seed(4);
  for (const int64_t padding_idx : {int64_t{1}, int64_t{-9}}) {
    posenc::LearnedPositionalEncoding m(posenc::LearnedPositionalEncodingOptions(8).max_len(9).dropout(0.0)
                                            .padding_idx(padding_idx));
    const int64_t row = padding_idx < 0 ? padding_idx + 9 : padding_idx;
    EXPECT_TRUE(torch::equal(m->pe[0][row], torch::zeros({8})));
    std::ostringstream printed;
    m->pretty_print(printed);
    EXPECT_NE(printed.str().find("padding_idx=" + std::to_string(row)), std::string::npos)
        << printed.str();
    {
      torch::NoGradGuard no_grad;
      m->pe[0][row].fill_(0.5);  // a loaded row is added as it is
    }
    torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(9, 8).padding_idx(row));
    {
      torch::NoGradGuard no_grad;
      embedding->weight.copy_(m->pe[0]);
    }
    const auto pos = torch::tensor({{0, 1, 2, 1}, {3, 1, 8, 4}}, torch::kLong);
    for (int call = 0; call < 2; ++call) {
      const auto x = torch::randn({2, 4, 8}), g = torch::randn({2, 4, 8});
      const auto y = m(x, 0, pos);
      EXPECT_TRUE(torch::equal(y, x + m->pe[0].detach().index({pos})));
      y.backward(g);
      (x + embedding(pos)).backward(g);
    }
    EXPECT_TRUE(torch::equal(m->pe.grad()[0][row], torch::zeros({8})));
    EXPECT_TRUE(torch::allclose(m->pe.grad()[0], embedding->weight.grad(), 0.0, 1e-6));
  }
  for (const int64_t bad : {int64_t{9}, int64_t{-10}}) {
    const auto options = posenc::LearnedPositionalEncodingOptions(8).max_len(9).padding_idx(bad);
    EXPECT_THROW(posenc::LearnedPositionalEncoding{options}, c10::ValueError);
  }
  // Set after construction (a trained table): that row gets no gradient from the next call,
  // its values kept (as Python's; torch::nn::Embedding zeroes the row at construction only).
  posenc::LearnedPositionalEncoding m(posenc::LearnedPositionalEncodingOptions(8).max_len(9).dropout(0.0));
  const auto table = m->pe.detach().clone();
  m->options.padding_idx(-7);  // row 2
  const auto x = torch::randn({2, 4, 8});
  const auto y = m(x);
  EXPECT_TRUE(torch::equal(y, x + table[0].narrow(0, 0, 4)));
  y.backward(torch::ones_like(y));
  EXPECT_TRUE(torch::equal(m->pe.grad()[0][2], torch::zeros({8})));
  EXPECT_TRUE(torch::equal(m->pe.grad()[0][1], torch::full({8}, 2.0f)));
  std::ostringstream printed;
  m->pretty_print(printed);
  EXPECT_NE(printed.str().find("padding_idx=2"), std::string::npos) << printed.str();
  m->options.padding_idx(9);
  EXPECT_THROW(m(x), c10::ValueError);
}

// create_graph: the gradients of x and of the table are linear in the incoming gradient g
// with the forward's mask, so d/dg of <grad_x, v> + <grad_table, w> is (v + w[rows]) * mask * scale.
TEST(LearnedPositionalEncodingModule, SecondDerivativeFollowsTheFormula) {
  torch::manual_seed(5);
  posenc::LearnedPositionalEncoding m(
      posenc::LearnedPositionalEncodingOptions(8).max_len(16).dropout(0.5));
  m->to(torch::kDouble);
  m->train();
  auto x = torch::randn({2, 5, 8}, torch::dtype(torch::kDouble).requires_grad(true));
  auto g = (torch::rand({2, 5, 8}, torch::kDouble) + 0.5).requires_grad_(true);
  auto y = m(x, 4);
  auto grads = torch::autograd::grad({y}, {x, m->pe}, {g}, /*retain_graph=*/true,
                                     /*create_graph=*/true);
  auto v = torch::randn_like(grads[0]);
  auto w = torch::randn_like(grads[1]);
  auto dg = torch::autograd::grad({(grads[0] * v).sum() + (grads[1] * w).sum()}, {g})[0];
  auto factor = grads[0].detach() / g.detach();  // 0 or 2
  EXPECT_TRUE(factor.eq(0).any().item<bool>() && factor.eq(2).any().item<bool>());
  auto want = (v + w[0].slice(0, 4, 9)) * factor;
  EXPECT_TRUE(torch::allclose(dg, want, 1e-12, 1e-12));
}

// init_std 0: a table of +0, as Python's zeros_ (the scaled draw left -0 where it was
// negative: -0 + -0 is -0 where Python's module gives +0).
TEST(LearnedPositionalEncodingModule, ZeroInitStdIsPositiveZeros) {
  posenc::LearnedPositionalEncoding m(posenc::LearnedPositionalEncodingOptions(4).max_len(64).init_std(0.0));
  EXPECT_FALSE(torch::signbit(m->pe).any().item<bool>());
  EXPECT_TRUE(torch::equal(m->pe, torch::zeros({1, 64, 4})));
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
  EXPECT_TRUE(torch::equal(a->pe, b->pe));
  // Options edited without reset(): the table is checked against pe's shape (a (6, 16) table
  // passed the edited options' check and was reshaped into pe's 12 rows of 8, scrambled).
  a->options.max_len(6).d_model(16);
  EXPECT_THROW(a->load_table(torch::randn({6, 16})), c10::ValueError);
  a->load_table(table);
  EXPECT_TRUE(torch::equal(a->pe[0], table));
  a->options.max_len(12).d_model(8);
  // Another max_len: refused, the trained table kept (and load_table still works).
  posenc::LearnedPositionalEncoding c(posenc::LearnedPositionalEncodingOptions(8).max_len(5));
  const auto kept = c->pe.clone();
  EXPECT_THROW(torch::load(c, path), c10::Error);
  std::remove(path.c_str());
  EXPECT_TRUE(torch::equal(c->pe, kept));
  EXPECT_TRUE(c->pe.requires_grad());
  c->load_table(torch::ones({5, 8}));
  EXPECT_TRUE(torch::equal(c->pe[0], torch::ones({5, 8})));
  // A float32 archive into a float64 module: cast (LibTorch's load failed with "setStorage:
  // out of bounds", reading float64 from float32 bytes), the parameter kept trainable.
  torch::save(a, path);
  posenc::LearnedPositionalEncoding d(posenc::LearnedPositionalEncodingOptions(8).max_len(12));
  d->to(torch::kDouble);
  torch::load(d, path);
  std::remove(path.c_str());
  EXPECT_TRUE(torch::equal(d->pe, a->pe.to(torch::kDouble)));
  EXPECT_TRUE(d->pe.requires_grad() && d->pe.is_leaf());
}

TEST(Helpers, MakePositions) {
  auto tokens = torch::tensor({5, 6, 1, 1, 1, 7, 8, 9}, torch::kLong).reshape({2, 4});
  auto want = torch::tensor({2, 3, 1, 1, 1, 2, 3, 4}, torch::kLong).reshape({2, 4});
  EXPECT_TRUE(torch::equal(posenc::make_positions(tokens, 1), want));
  // offset (transformers' past_key_values_length): non-padding tokens move on, padding stays.
  auto after = torch::tensor({5, 6, 1, 1, 1, 5, 6, 7}, torch::kLong).reshape({2, 4});
  EXPECT_TRUE(torch::equal(posenc::make_positions(tokens, 1, 3), after));
  EXPECT_THROW(posenc::make_positions(tokens, 1, -1), c10::ValueError);
  EXPECT_THROW(posenc::make_positions(torch::rand({2, 3}), 1), c10::Error);
  EXPECT_THROW(posenc::make_positions(tokens, std::numeric_limits<int64_t>::max()), c10::ValueError);
}

TEST(Helpers, Sinusoidal2dTableRefusesBadBaseAndDtype) {
  EXPECT_THROW(posenc::sinusoidal_2d_table(2, 2, 8, 1.0, 0, torch::kFloat), c10::ValueError);
  EXPECT_THROW(posenc::sinusoidal_2d_table(2, 2, 8, std::nan(""), 0, torch::kFloat), c10::ValueError);
  EXPECT_THROW(posenc::sinusoidal_2d_table(2, 2, 8, 100.0, 0, torch::kLong), c10::TypeError);
  EXPECT_EQ(posenc::sinusoidal_2d_table(2, 2, 8, 100.0, 0, torch::kHalf).scalar_type(), torch::kHalf);
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


TEST(LearnedPositionalEncodingModule, OutOfRangePositionsThrowIndexError) {
  // CPU positions are checked in the kernel; CUDA ones by the module on the host.
  std::vector<torch::Device> devices{torch::kCPU};
  if (torch::cuda::is_available()) devices.emplace_back(torch::kCUDA);
  for (const auto& device : devices) {
    posenc::LearnedPositionalEncoding m(posenc::LearnedPositionalEncodingOptions(8).max_len(16));
    m->to(device);
    auto x = torch::randn({2, 5, 8}, torch::TensorOptions().device(device));
    auto pos = [&](std::vector<int64_t> v) { return torch::tensor(v, torch::kLong).to(device); };
    EXPECT_THROW(m(x, 0, pos({0, -1, 2, 3, 4})), c10::IndexError);
    EXPECT_THROW(m(x, 0, pos({0, 1, 16, 3, 4})), c10::IndexError);
    EXPECT_THROW(m(x, 0, pos({0, 1, 2, 3, 4, 5, 6, 7, 8, -4}).reshape({2, 5})), c10::IndexError);
    EXPECT_THROW(m(x, 0, pos({0, 1, 2, 3, 4, 5, 6, 700, 8, 9}).reshape({2, 5})), c10::IndexError);
    try {
      m(x, 0, pos({0, 1, 16, 3, 4}));
      ADD_FAILURE() << "no exception";
    } catch (const c10::IndexError& e) {
      EXPECT_NE(std::string(e.what()).find("max_len=16"), std::string::npos) << e.what();
    }
    // The last valid row works.
    m->eval();
    torch::NoGradGuard no_grad;
    auto ok = pos({15, 0, 15, 3, 4});
    EXPECT_TRUE(torch::equal(m(x, 0, ok), x + m->pe.index_select(1, ok)));
  }
}

TEST(Helpers, ResampleBicubicEqualsInterpolate) {
  namespace F = torch::nn::functional;
  torch::manual_seed(1);
  const int64_t dim = 8;
  for (auto [old_h, old_w, new_h, new_w, prefix] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>{
           {6, 6, 9, 5, 1}, {12, 12, 5, 7, 1}, {8, 2, 4, 4, 2}, {5, 7, 10, 3, 0}}) {
    auto pe = torch::randn({1, prefix + old_h * old_w, dim});
    auto out = posenc::resample_position_table(pe, new_h, new_w, old_h, old_w, prefix);
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, prefix + new_h * new_w, dim}));
    auto grid = pe.slice(1, prefix).reshape({1, old_h, old_w, dim}).permute({0, 3, 1, 2});
    auto image = F::interpolate(grid, F::InterpolateFuncOptions()
                                          .size(std::vector<int64_t>{new_h, new_w})
                                          .mode(torch::kBicubic)
                                          .align_corners(false)
                                          .antialias(true));
    auto want = image.permute({0, 2, 3, 1}).reshape({1, new_h * new_w, dim});
    EXPECT_TRUE(torch::equal(out.slice(1, prefix), want)) << old_h << "x" << old_w;
    EXPECT_TRUE(torch::equal(out.slice(1, 0, prefix), pe.slice(1, 0, prefix)));
    EXPECT_FALSE(torch::equal(out.slice(1, prefix), out.slice(1, prefix).mean(1, true).expand_as(want)));
  }
  // antialias=false and nearest are passed through too; an unknown mode is rejected.
  auto pe = torch::randn({1, 1 + 144, dim});
  auto grid = pe.slice(1, 1).reshape({1, 12, 12, dim}).permute({0, 3, 1, 2});
  auto no_aa = posenc::resample_position_table(pe, 5, 7, std::nullopt, std::nullopt, 1, "bicubic", false);
  auto want_no_aa = F::interpolate(grid, F::InterpolateFuncOptions()
                                             .size(std::vector<int64_t>{5, 7})
                                             .mode(torch::kBicubic)
                                             .align_corners(false)
                                             .antialias(false))
                        .permute({0, 2, 3, 1})
                        .reshape({1, 35, dim});
  EXPECT_TRUE(torch::equal(no_aa.slice(1, 1), want_no_aa));
  EXPECT_FALSE(torch::equal(no_aa, posenc::resample_position_table(pe, 5, 7)));
  auto nearest = posenc::resample_position_table(pe, 5, 7, std::nullopt, std::nullopt, 1, "nearest");
  auto want_nearest = F::interpolate(grid, F::InterpolateFuncOptions()
                                               .size(std::vector<int64_t>{5, 7})
                                               .mode(torch::kNearest))
                          .permute({0, 2, 3, 1})
                          .reshape({1, 35, dim});
  EXPECT_TRUE(torch::equal(nearest.slice(1, 1), want_nearest));
  EXPECT_THROW(posenc::resample_position_table(pe, 5, 7, std::nullopt, std::nullopt, 1, "bogus"),
               c10::ValueError);
  // A bfloat16 table is resampled in float32 and cast back.
  auto half = pe.to(torch::kBFloat16);
  auto out_half = posenc::resample_position_table(half, 9, 9);
  EXPECT_EQ(out_half.scalar_type(), torch::kBFloat16);
  auto want_half = F::interpolate(half.slice(1, 1).to(torch::kFloat).reshape({1, 12, 12, dim}).permute({0, 3, 1, 2}),
                                  F::InterpolateFuncOptions()
                                      .size(std::vector<int64_t>{9, 9})
                                      .mode(torch::kBicubic)
                                      .align_corners(false)
                                      .antialias(true))
                       .permute({0, 2, 3, 1})
                       .reshape({1, 81, dim})
                       .to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(out_half.slice(1, 1), want_half));
}

TEST(LearnedPositionalEncodingModule, LoadTable3dAndNamedParameters) {
  posenc::LearnedPositionalEncoding m(posenc::LearnedPositionalEncodingOptions(8).max_len(12));
  auto table = torch::randn({1, 12, 8});
  m->load_table(table);
  EXPECT_TRUE(torch::equal(m->pe, table));
  EXPECT_TRUE(m->pe.requires_grad());
  EXPECT_THROW(m->load_table(torch::randn({2, 12, 8})), c10::ValueError);
  EXPECT_THROW(m->load_table(torch::randn({1, 12, 9})), c10::ValueError);
  EXPECT_THROW(m->load_table(torch::randn({12})), c10::ValueError);
  // A complex table would lose its imaginary part in copy_; a meta one holds no data.
  EXPECT_THROW(m->load_table(torch::randn({12, 8}, torch::kComplexFloat)), c10::TypeError);
  EXPECT_THROW(m->load_table(torch::empty({12, 8}, torch::Device(torch::kMeta))), c10::TypeError);
  EXPECT_TRUE(torch::equal(m->pe, table));
  auto params = m->named_parameters();
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(params.keys(), (std::vector<std::string>{"pe"}));
  EXPECT_TRUE(params["pe"].is_same(m->pe));
  EXPECT_EQ(m->named_buffers().size(), 0u);
  // The loaded table is what the forward adds.
  m->eval();
  torch::NoGradGuard no_grad;
  auto x = torch::randn({3, 12, 8});
  EXPECT_TRUE(torch::equal(m(x), x + table));
}

TEST(LearnedPositionalEncodingModule, RejectsBadOptions) {
  using Opts = posenc::LearnedPositionalEncodingOptions;
  using Module = posenc::LearnedPositionalEncoding;
  EXPECT_THROW(Module(Opts(8).init_std(-0.01)), c10::ValueError);
  EXPECT_THROW(Module(Opts(8).init_std(std::numeric_limits<double>::infinity())), c10::ValueError);
  EXPECT_THROW(Module(Opts(8).init_std(std::numeric_limits<double>::quiet_NaN())), c10::ValueError);
  EXPECT_THROW(Module(Opts(0)), c10::ValueError);
  EXPECT_THROW(Module(Opts(-4)), c10::ValueError);
  EXPECT_THROW(Module(Opts(8).max_len(0)), c10::ValueError);
  EXPECT_THROW(Module(Opts(8).max_len(-1)), c10::ValueError);
  EXPECT_THROW(Module(Opts(8).dropout(-0.1)), c10::ValueError);
  EXPECT_THROW(Module(Opts(8).dropout(1.5)), c10::ValueError);
  EXPECT_THROW(Module(Opts(8).dropout(std::numeric_limits<double>::quiet_NaN())), c10::ValueError);
  // The boundaries are accepted; init_std 0 gives a zero table.
  EXPECT_NO_THROW(Module(Opts(8).max_len(1).dropout(0.0)));
  EXPECT_NO_THROW(Module(Opts(8).dropout(1.0)));
  Module zero(Opts(8).max_len(4).init_std(0.0));
  EXPECT_TRUE(torch::equal(zero->pe, torch::zeros({1, 4, 8})));
}

// An op called boxed, by name, every argument given as an IValue: no typed handle and no
// C++ default involved, as torch.ops.posenc.<name>(...) from Python.
c10::IValue call_op(const char* name, std::vector<c10::IValue> args) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack(std::make_move_iterator(args.begin()),
                          std::make_move_iterator(args.end()));
  op.callBoxed(&stack);
  return stack.size() == 1 ? stack[0] : c10::IValue(c10::ivalue::Tuple::create(stack));
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && torch::equal(a, b);
}

// The C++ helpers call the ops the Python helpers call (tests/python/test_helper_ops.py
// checks posenc.functional.* == torch.ops.posenc.*), so both languages give the same bits.
TEST(Helpers, CppFunctionsCallTheOps) {
  for (auto [h, w, dim, prefix, base, dtype] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, double, torch::ScalarType>>{
           {1, 1, 4, 0, 10000.0, torch::kFloat},
           {3, 5, 8, 0, 10000.0, torch::kDouble},
           {4, 4, 16, 1, 100.0, torch::kFloat},
           {14, 14, 768, 1, 10000.0, torch::kDouble},
           {7, 3, 192, 4, 2.5, torch::kBFloat16},
           {16, 16, 1024, 1, 1e6, torch::kHalf}}) {
    const auto got = posenc::sinusoidal_2d_table(h, w, dim, base, prefix, dtype);
    const auto want =
        call_op("posenc::sinusoidal_2d_table",
                {h, w, dim, base, prefix, dtype, c10::IValue(), c10::IValue(), 1.0})
            .toTensor();
    EXPECT_TRUE(same_bits(got, want)) << h << "x" << w << " dim " << dim;
  }
  // The C++ defaults are the schema's.
  EXPECT_TRUE(same_bits(
      posenc::sinusoidal_2d_table(3, 4, 16),
      call_op("posenc::sinusoidal_2d_table",
              {3, 4, 16, 10000.0, 0, c10::IValue(), c10::IValue(), c10::IValue(), 1.0})
          .toTensor()));
  // diffusers' rescaled coordinates (base_size, interpolation_scale), the same bits too.
  for (auto [h, w, base_size, scale] :
       std::vector<std::tuple<int64_t, int64_t, std::optional<double>, double>>{
           {4, 4, 16.0, 1.0}, {7, 5, 3.0, 2.0}, {64, 64, 64.0, 2.0}, {9, 6, std::nullopt, 0.75},
           {5, 11, 2.5, 1.0}}) {
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      const auto got = posenc::sinusoidal_2d_table(h, w, 32, 10000.0, 1, dtype, std::nullopt,
                                                   base_size, scale);
      const c10::IValue base_size_arg =
          base_size.has_value() ? c10::IValue(*base_size) : c10::IValue();
      const auto want = call_op("posenc::sinusoidal_2d_table",
                                {h, w, 32, 10000.0, 1, dtype, c10::IValue(), base_size_arg, scale})
                            .toTensor();
      EXPECT_TRUE(same_bits(got, want)) << h << "x" << w;
    }
  }
  const auto meta = posenc::sinusoidal_2d_table(3, 4, 16, 10000.0, 1, torch::kFloat, torch::kMeta);
  EXPECT_TRUE(meta.is_meta());
  EXPECT_EQ(meta.sizes(), (std::vector<int64_t>{13, 16}));

  torch::manual_seed(3);
  const auto tokens = torch::randint(0, 3, {4, 9}, torch::kLong);
  for (int64_t padding_idx : std::vector<int64_t>{0, 1, -5, int64_t{1} << 62}) {
    for (int64_t offset : std::vector<int64_t>{0, 5}) {
      EXPECT_TRUE(same_bits(posenc::make_positions(tokens, padding_idx, offset),
                            call_op("posenc::make_positions", {tokens, padding_idx, offset}).toTensor()));
    }
  }

  const auto pe = torch::randn({1, 2 + 12 * 12, 8});
  for (const char* mode : {"bicubic", "bilinear", "nearest"}) {
    for (bool antialias : {true, false}) {
      const auto got =
          posenc::resample_position_table(pe, 5, 7, std::nullopt, std::nullopt, 2, mode, antialias);
      const auto want =
          call_op("posenc::resample_position_table",
                  {pe, std::vector<int64_t>{5, 7}, c10::IValue(), 2, std::string(mode), antialias})
              .toTensor();
      EXPECT_TRUE(same_bits(got, want)) << mode << " antialias " << antialias;
    }
  }
  const auto wide = torch::randn({1, 1 + 8 * 2, 8}).to(torch::kBFloat16);
  EXPECT_TRUE(same_bits(posenc::resample_position_table(wide, 4, 4, 8, 2),
                        call_op("posenc::resample_position_table",
                                {wide, std::vector<int64_t>{4, 4}, std::vector<int64_t>{8, 2}, 1,
                                 std::string("bicubic"), true})
                            .toTensor()));
  EXPECT_THROW(posenc::resample_position_table(pe, 4, 4, 8, std::nullopt), c10::ValueError);

  const auto t = torch::rand({11}) * 1000;
  for (int64_t dim : {1, 4, 9, 320}) {
    EXPECT_TRUE(same_bits(
        posenc::timestep_embedding(t, dim, 10000.0, false, 0.0),
        call_op("posenc::timestep_embedding", {t, dim, 10000.0, false, 0.0, 1.0}).toTensor()));
    EXPECT_TRUE(same_bits(
        posenc::timestep_embedding(t, dim, 500.0, true, 0.0, 1000.0),
        call_op("posenc::timestep_embedding", {t, dim, 500.0, true, 0.0, 1000.0}).toTensor()));
  }
  EXPECT_TRUE(same_bits(
      posenc::timestep_embedding(t, 320),
      call_op("posenc::timestep_embedding", {t, 320, 10000.0, false, 1.0, 1.0}).toTensor()));
}

// diffusers' get_timestep_embedding, operation for operation in float32 (the pytest
// test_timestep_embedding_matches_diffusers checks the Python side against the same formula).
TEST(Helpers, TimestepEmbeddingMatchesDiffusersFormula) {
  torch::manual_seed(4);
  const auto t = torch::rand({13}) * 1000;
  for (int64_t dim : {4, 9, 320}) {
    for (bool flip : {false, true}) {
      for (auto [shift, scale, period] : std::vector<std::tuple<double, double, double>>{
               {1.0, 1.0, 10000.0}, {0.0, 1000.0, 500.0}}) {
        const int64_t half = dim / 2;
        auto exponent = -std::log(period) * torch::arange(half, torch::kFloat);
        exponent = exponent / (half - shift);
        auto emb = t.unsqueeze(1).to(torch::kFloat) * torch::exp(exponent).unsqueeze(0);
        emb = scale * emb;
        emb = torch::cat({torch::sin(emb), torch::cos(emb)}, -1);
        if (flip) emb = torch::cat({emb.slice(1, half), emb.slice(1, 0, half)}, -1);
        if (dim % 2 == 1) emb = torch::constant_pad_nd(emb, {0, 1, 0, 0});
        EXPECT_TRUE(same_bits(posenc::timestep_embedding(t, dim, period, flip, shift, scale), emb))
            << dim << " " << flip << " " << shift;
      }
    }
  }
  EXPECT_THROW(posenc::timestep_embedding(t, 3), c10::ValueError);  // 0 / 0 in diffusers
  EXPECT_THROW(posenc::timestep_embedding(t.reshape({13, 1}), 8), c10::ValueError);
  EXPECT_THROW(posenc::timestep_embedding(t, 8, std::nan("")), c10::ValueError);
  EXPECT_THROW(posenc::timestep_embedding(t.to(torch::kComplexFloat), 8), c10::TypeError);
}

std::string message_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no exception";
}

// The ops write values as Python does, so a message reads the same from both languages.
TEST(Helpers, MessagesReadLikePython) {
  auto contains = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  std::string m = message_of([] { posenc::sinusoidal_2d_table(2, 2, 8, 1.0); });
  EXPECT_TRUE(contains(m, "sinusoidal_2d_table: expected base to be a finite number > 1, got 1.0"))
      << m;
  m = message_of([] { posenc::sinusoidal_2d_table(2, 2, 8, 100.0, 0, torch::kLong); });
  EXPECT_TRUE(contains(m, "expected dtype to be float16, bfloat16, float32 or float64, got torch.int64")) << m;
  m = message_of([] { posenc::resample_position_table(torch::randn({1, 17, 8}), 6, 6, 4, 5); });
  EXPECT_TRUE(contains(m, "old_grid (4, 5) has 20 cells but the table has 16 patch rows")) << m;
  m = message_of([] {
    posenc::resample_position_table(torch::randn({1, 17, 8}), 6, 6, std::nullopt, std::nullopt, 1,
                                    "bogus");
  });
  EXPECT_TRUE(contains(m, "expected mode bicubic, bilinear or nearest, got 'bogus'")) << m;
  m = message_of([] { posenc::timestep_embedding(torch::rand({2}), 8, 0.0); });
  EXPECT_TRUE(contains(m, "expected max_period to be a finite number > 0, got 0.0")) << m;
  m = message_of([] { posenc::timestep_embedding(torch::rand({2}), 2); });
  EXPECT_TRUE(contains(m, "half of dim (1) minus downscale_freq_shift (1.0) must not be zero"))
      << m;
  m = message_of([] { posenc::make_positions(torch::rand({2, 3}), 1); });
  EXPECT_TRUE(contains(
      m, "expected integer tokens of shape (batch, seq), got torch.float32 tokens of shape (2, 3)"))
      << m;
}

// diffusers' get_2d_sincos_pos_embed with base_size and interpolation_scale (PixArt, SD3),
// written from its formula: per axis arange(n, float32) / (n / base_size) /
// interpolation_scale in float32, then MAE's float64 table on those coordinates
// (tests/python/test_sinusoidal_2d_table.py checks the Python side against numpy).
TEST(Helpers, Sinusoidal2dTableRescaledCoordinatesAreDiffusers) {
  const int64_t dim = 16;
  for (auto [h, w, base_size, scale] : std::vector<std::tuple<int64_t, int64_t, double, double>>{
           {4, 4, 16.0, 1.0}, {3, 5, 2.0, 1.5}, {7, 2, 64.0, 2.0}, {6, 9, 5.0, 0.5}}) {
    const auto table = posenc::sinusoidal_2d_table(h, w, dim, 10000.0, 2, torch::kDouble,
                                                   std::nullopt, base_size, scale);
    ASSERT_EQ(table.sizes(), (std::vector<int64_t>{2 + h * w, dim}));
    EXPECT_EQ(table.slice(0, 0, 2).abs().sum().item<double>(), 0.0);
    auto axis = [&, base_size = base_size, scale = scale](int64_t n) {
      std::vector<double> coords;
      for (int64_t i = 0; i < n; ++i) {
        float c = static_cast<float>(i) / static_cast<float>(static_cast<double>(n) / base_size);
        coords.push_back(c / static_cast<float>(scale));
      }
      return coords;
    };
    const auto hs = axis(h), ws = axis(w);
    auto acc = table.accessor<double, 2>();
    for (int64_t r = 0; r < h; ++r) {
      for (int64_t c = 0; c < w; ++c) {
        for (int64_t i = 0; i < dim / 4; ++i) {
          const double omega = 1.0 / std::pow(10000.0, i / (dim / 4.0));
          const int64_t row = 2 + r * w + c;
          EXPECT_NEAR(acc[row][i], std::sin(ws[c] * omega), 1e-12);  // w: first half
          EXPECT_NEAR(acc[row][dim / 4 + i], std::cos(ws[c] * omega), 1e-12);
          EXPECT_NEAR(acc[row][dim / 2 + i], std::sin(hs[r] * omega), 1e-12);  // h: second
          EXPECT_NEAR(acc[row][3 * dim / 4 + i], std::cos(hs[r] * omega), 1e-12);
        }
      }
    }
  }
  // The defaults (no base_size, scale 1) are MAE's integer coordinates, bit for bit.
  EXPECT_TRUE(same_bits(posenc::sinusoidal_2d_table(5, 3, 24),
                        posenc::sinusoidal_2d_table(5, 3, 24, 10000.0, 0, torch::kFloat,
                                                    std::nullopt, std::nullopt, 1.0)));
  // base_size = grid size and scale 1 are integer coordinates too.
  EXPECT_TRUE(same_bits(posenc::sinusoidal_2d_table(6, 6, 24),
                        posenc::sinusoidal_2d_table(6, 6, 24, 10000.0, 0, torch::kFloat,
                                                    std::nullopt, 6.0)));
  EXPECT_THROW(posenc::sinusoidal_2d_table(2, 2, 8, 10000.0, 0, torch::kFloat, std::nullopt, 0.0),
               c10::ValueError);
  EXPECT_THROW(posenc::sinusoidal_2d_table(2, 2, 8, 10000.0, 0, torch::kFloat, std::nullopt,
                                           std::nullopt, -1.0),
               c10::ValueError);
  const std::string m = message_of([] {
    posenc::sinusoidal_2d_table(2, 2, 8, 10000.0, 0, torch::kFloat, std::nullopt, std::nan(""));
  });
  EXPECT_NE(m.find("sinusoidal_2d_table: expected base_size to be None or a finite number > 0, "
                   "got nan"),
            std::string::npos)
      << m;
}

// posenc::Timesteps is diffusers' Timesteps: forward(t) is timestep_embedding with its
// options, bit for bit; no parameters or buffers (an empty state dict).
TEST(TimestepsModule, ForwardIsTheFunction) {
  torch::manual_seed(5);
  const auto t = torch::rand({9}) * 1000;
  for (auto [channels, flip, shift, scale, period] :
       std::vector<std::tuple<int64_t, bool, double, double, double>>{
           {256, true, 0.0, 1.0, 10000.0}, {320, false, 1.0, 1.0, 10000.0},
           {33, true, 1.0, 1000.0, 500.0}, {1, false, 0.0, 1.0, 10000.0}}) {
    posenc::Timesteps m(
        posenc::TimestepsOptions(channels, flip, shift).scale(scale).max_period(period));
    EXPECT_TRUE(same_bits(m(t), posenc::timestep_embedding(t, channels, period, flip, shift, scale)))
        << channels;
    EXPECT_TRUE(m->named_parameters().is_empty());
    EXPECT_TRUE(m->named_buffers().is_empty());
  }
  posenc::Timesteps plain(256, true, 0.0);  // diffusers' positional form
  EXPECT_TRUE(same_bits(plain(t.to(torch::kLong)),
                        posenc::timestep_embedding(t.to(torch::kLong), 256, 10000.0, true, 0.0)));
  std::ostringstream repr;
  repr << *plain;
  EXPECT_EQ(repr.str(), "posenc::Timesteps(num_channels=256, flip_sin_to_cos=true, "
                        "downscale_freq_shift=0, scale=1, max_period=10000)");
  // Bad options fail when the module is built, with the op's messages.
  const std::string m = message_of([] { posenc::Timesteps(2, false, 1.0); });
  EXPECT_NE(m.find("half of dim (1) minus downscale_freq_shift (1.0) must not be zero"),
            std::string::npos)
      << m;
  EXPECT_THROW(posenc::Timesteps(posenc::TimestepsOptions(8, false, 1.0).max_period(0.0)),
               c10::ValueError);
  EXPECT_THROW(posenc::Timesteps(0, false, 1.0), c10::ValueError);
  EXPECT_THROW(plain(t.reshape({3, 3})), c10::ValueError);
}

TEST(Helpers, PyFloatWritesWhatReprWrites) {
  using posenc::ops::py_float;
  const std::vector<std::pair<double, std::string>> cases{
      {0.0, "0.0"},
      {-0.0, "-0.0"},
      {1.0, "1.0"},
      {-2.5, "-2.5"},
      {0.1, "0.1"},
      {1e-4, "0.0001"},
      {1e-5, "1e-05"},
      {1.5e-7, "1.5e-07"},
      {123.456, "123.456"},
      {1e15, "1000000000000000.0"},
      {1e16, "1e+16"},
      {12345678901234567.0, "1.2345678901234568e+16"},
      {0.1 + 0.2, "0.30000000000000004"},
      {5e-324, "5e-324"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {1e100, "1e+100"},
      {std::nan(""), "nan"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {-std::numeric_limits<double>::infinity(), "-inf"}};
  for (const auto& [value, repr] : cases) EXPECT_EQ(py_float(value), repr);
  EXPECT_EQ(posenc::ops::py_tuple(std::vector<int64_t>{5}), "(5,)");
  EXPECT_EQ(posenc::ops::py_tuple(std::vector<int64_t>{4, 5}), "(4, 5)");
  EXPECT_EQ(posenc::ops::py_dtype(torch::kBFloat16), "torch.bfloat16");
}

// The add-position modules' range check: op position_bounds, one read-back of (min, max).
TEST(LearnedPositionalEncodingModule, PositionBoundsOp) {
  const auto pos = torch::tensor({3, 0, 7, 2, 9, 1}, torch::kLong).reshape({2, 3});
  auto bounds = call_op("posenc::position_bounds", {pos, c10::IValue()}).toTuple();
  EXPECT_EQ(bounds->elements()[0].toInt(), 0);
  EXPECT_EQ(bounds->elements()[1].toInt(), 9);
  bounds = call_op("posenc::position_bounds", {torch::empty({0}, torch::kLong), 0}).toTuple();
  EXPECT_EQ(bounds->elements()[1].toInt(), -1);
  const std::string m = message_of([&] { call_op("posenc::position_bounds", {pos, 9}); });
  EXPECT_NE(
      m.find("posenc: expected positions in [0, max_len=9), found 9 (positions range from 0 to 9)"),
      std::string::npos)
      << m;
  EXPECT_THROW(call_op("posenc::position_bounds", {pos, 9}), c10::IndexError);
  EXPECT_THROW(call_op("posenc::position_bounds", {pos.to(torch::kFloat), 9}), c10::TypeError);
  // The CPU kernel's per-element check writes the same message, with the element's index.
  posenc::LearnedPositionalEncoding module(posenc::LearnedPositionalEncodingOptions(8).max_len(16));
  const std::string k = message_of([&] {
    module(torch::randn({2, 5, 8}), 0, torch::tensor({0, 1, 16, 3, 4}, torch::kLong));
  });
  EXPECT_NE(k.find("posenc: expected positions in [0, max_len=16), found 16 at flat index 2"),
            std::string::npos)
      << k;
}

}  // namespace
