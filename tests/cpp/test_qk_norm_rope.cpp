// GoogleTest: posenc::qk_norm_rope (the C++ front end of the fused QK-norm + RoPE op)
// against RMSNorm written with ATen ops followed by posenc::apply_rope, and its gradients
// (C++ autograd) against autograd through that composition.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <torch/torch.h>

// The two umbrella headers alone: every function and module this file uses is declared by them.
#include "posenc/functional.h"
#include "posenc/modules.h"

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

TEST(QkNormRope, InPlaceWritesTheOutOfPlaceResultIntoQAndK) {
  torch::manual_seed(1);
  for (const bool hidden : {false, true}) {
    const int64_t B = 2, S = 3, Hq = 4, Hk = 2, D = 8;
    // q and k as slices of one (B, S, Hq + Hk, D) buffer: strided, in one storage.
    auto qk = torch::randn({B, S, Hq + Hk, D});
    auto q = qk.narrow(2, 0, Hq), k = qk.narrow(2, Hq, Hk);
    auto wq = torch::rand({hidden ? Hq * D : D}) + 0.5, wk = torch::rand({hidden ? Hk * D : D}) + 0.5;
    const auto o = posenc::QkNormRopeOptions()
                       .norm(hidden ? "hidden" : "head")
                       .rope(posenc::ApplyRopeOptions().offset(5).interleaved(true));
    auto [want_q, want_k] = posenc::qk_norm_rope(q, k, wq, wk, o);
    const auto version = q._version();
    posenc::qk_norm_rope_(q, k, wq, wk, o);
    EXPECT_TRUE(torch::equal(q, want_q));
    EXPECT_TRUE(torch::equal(k, want_k));
    EXPECT_GT(q._version(), version);
  }
  auto q = torch::randn({1, 2, 2, 8}, torch::requires_grad());
  auto k = torch::randn({1, 2, 1, 8});
  EXPECT_THROW(posenc::qk_norm_rope_(q, k, torch::ones({8}), torch::ones({8})), c10::Error);
  {
    torch::NoGradGuard no_grad;
    posenc::qk_norm_rope_(q, k, torch::ones({8}), torch::ones({8}));
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

namespace {

TEST(QKNormRotaryModule, HoldsHuggingFacesWeightsAndMatchesTheFunction) {
  torch::manual_seed(1);
  const auto rope = posenc::ApplyRopeOptions().base(1e6).rotary_dim(8);
  posenc::QKNormRotary m(posenc::QKNormRotaryOptions(16).eps(1e-5).rope(rope));
  std::vector<std::string> names;
  for (const auto& p : m->named_parameters()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"q_norm.weight", "k_norm.weight"}));
  EXPECT_TRUE(torch::equal(m->q_norm->weight, torch::ones({16})));
  torch::NoGradGuard no_grad;
  m->q_norm->weight.uniform_(0.5, 1.5);
  m->k_norm->weight.uniform_(0.5, 1.5);
  const auto q = torch::randn({2, 5, 4, 16}), k = torch::randn({2, 5, 2, 16});
  const auto pos = torch::tensor({3, 1, 4, 1, 5}, torch::kLong);
  auto [oq, ok] = m(q, k, posenc::RopePositions().positions(pos));
  auto [wq, wk] = posenc::qk_norm_rope(q, k, m->q_norm->weight, m->k_norm->weight,
                                       posenc::QkNormRopeOptions().eps(1e-5).rope(
                                           posenc::ApplyRopeOptions(rope).positions(pos)));
  EXPECT_TRUE(torch::equal(oq, wq));
  EXPECT_TRUE(torch::equal(ok, wk));
  auto [oq2, ok2] = m(q, k, posenc::RopePositions().offset(7));  // another position: other numbers
  EXPECT_FALSE(torch::allclose(oq2, oq));
}

TEST(QKNormRotaryModule, GemmaOffsetHiddenNormAndGradients) {
  // Gemma's (1 + w): the weights start at 0. OLMo 2's hidden norm: heads * head_dim weights.
  posenc::QKNormRotary gemma(posenc::QKNormRotaryOptions(8).weight_offset(1.0));
  EXPECT_TRUE(torch::equal(gemma->k_norm->weight, torch::zeros({8})));
  posenc::QKNormRotary olmo(posenc::QKNormRotaryOptions(8).norm("hidden").num_heads(4).num_kv_heads(2));
  EXPECT_EQ(olmo->q_norm->weight.size(0), 32);
  EXPECT_EQ(olmo->k_norm->weight.size(0), 16);
  auto [oq, ok] = olmo(torch::randn({1, 3, 4, 8}), torch::randn({1, 3, 2, 8}));
  (oq.square().sum() + ok.sum()).backward();
  ASSERT_TRUE(olmo->q_norm->weight.grad().defined());
  EXPECT_GT(olmo->q_norm->weight.grad().abs().sum().item<double>(), 0.0);
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8).norm("hidden")), c10::ValueError);
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8).norm("layer")), c10::Error);
}

}  // namespace

// Both modules parse their RoPE options once, at construction, and the op checks them then
// (rope_rotary_width: the one statement of the rotary-width rule).
TEST(QKNormRotaryModule, TheOpChecksTheRopeOptionsAtConstruction) {
  // eps checked when built, as Python's QKNormRotary does (it passed until the first forward).
  for (const double eps : {0.0, -1.0, std::nan("")}) {
    EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8).eps(eps)), c10::ValueError) << eps;
  }
  // partial_rotary_factor outside "proportional" (where it is rotary_dim in a transformers
  // config) is refused: it was ignored (the whole head turned, 5.2 off Python's result).
  posenc::RopeScaling partial;
  partial.partial_rotary_factor = 0.5;
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8).rope(posenc::ApplyRopeOptions().scaling(partial))),
               c10::ValueError);
  EXPECT_THROW(posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(8).scaling(partial)),
               c10::ValueError);
  EXPECT_THROW(posenc::apply_rope(torch::randn({1, 3, 2, 8}), posenc::ApplyRopeOptions().scaling(partial)),
               c10::ValueError);
  EXPECT_THROW(posenc::rope_frequencies(8, 10000.0, partial), c10::ValueError);
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8).rope(
                   posenc::ApplyRopeOptions().rotary_dim(7))),
               c10::ValueError);
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8).rope(
                   posenc::ApplyRopeOptions().rotary_offset(4).rotary_dim(6))),
               c10::ValueError);
  EXPECT_THROW(posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(8).sections({3, 3})),
               c10::ValueError);
  EXPECT_THROW(posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(8).base(1.0)),
               c10::ValueError);
  // The width: the rest of the head from rotary_offset, or 2 * sum(sections).
  EXPECT_EQ(posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(16).rotary_offset(6))
                ->inv_freq()
                .size(0),
            5);
  EXPECT_EQ(posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(24).sections({2, 3, 3}))
                ->inv_freq()
                .size(0),
            8);
  // The module's forward starts from the call parsed then: same bits as the function.
  torch::manual_seed(3);
  const auto q = torch::randn({2, 5, 3, 16});
  const auto k = torch::randn({2, 5, 1, 16});
  posenc::QKNormRotary m(posenc::QKNormRotaryOptions(16).rope(posenc::ApplyRopeOptions().rotary_offset(8)));
  auto [a, b] = m->forward(q, k, posenc::RopePositions().offset(3));
  auto [c, d] = posenc::qk_norm_rope(q, k, m->q_norm->weight, m->k_norm->weight,
                                     posenc::QkNormRopeOptions().rope(
                                         posenc::ApplyRopeOptions().rotary_offset(8).offset(3)));
  EXPECT_TRUE(torch::equal(a, c));
  EXPECT_TRUE(torch::equal(b, d));
}

// reset() after changing the options re-parses them and keeps the (trained) norm weights;
// it threw "Submodule 'q_norm' already defined". Positions in options.rope() were dropped
// silently: a ValueError now (they come with each call).
TEST(QKNormRotaryModule, ResetReparsesOptionsAndKeepsWeights) {
  auto q = torch::randn({1, 4, 2, 16}, torch::kDouble), k = torch::randn({1, 4, 1, 16}, torch::kDouble);
  posenc::QKNormRotary m(posenc::QKNormRotaryOptions(16));
  m->to(torch::kDouble);
  {
    torch::NoGradGuard no_grad;
    m->q_norm->weight.uniform_(0.5, 1.5);
  }
  const auto trained = m->q_norm->weight.clone();
  m->options.eps(0.5).weight_offset(1.0);
  m->reset();
  EXPECT_TRUE(torch::equal(m->q_norm->weight, trained));
  const auto want = posenc::qk_norm_rope(q, k, m->q_norm->weight, m->k_norm->weight,
                                         posenc::QkNormRopeOptions().eps(0.5).weight_offset(1.0));
  EXPECT_TRUE(torch::equal(std::get<0>(m(q, k)), std::get<0>(want)));
  auto clone = std::dynamic_pointer_cast<posenc::QKNormRotaryImpl>(m->clone());
  EXPECT_TRUE(torch::equal(std::get<0>((*clone).forward(q, k)), std::get<0>(want)));
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(16).rope(posenc::ApplyRopeOptions().offset(5))),
               c10::ValueError);
  // reset() of a norm weight a second time sets it back to its initial value (it registered
  // the parameter twice and threw).
  m->q_norm->reset();
  // (its init, 1 - weight_offset, is the one it was built with: offset 0)
  EXPECT_TRUE(torch::equal(m->q_norm->weight, torch::ones({16}, torch::kDouble)));
  EXPECT_EQ(m->q_norm->weight.scalar_type(), torch::kDouble);
}

// eps, weight_offset and norm are read from the options at each call, as Python's module
// reads its attributes: an edit without reset() was ignored silently (a bad eps too).
TEST(QKNormRotaryModule, NormSettingsAreReadAtEachCall) {
  auto q = torch::randn({1, 4, 2, 16}, torch::kDouble), k = torch::randn({1, 4, 1, 16}, torch::kDouble);
  posenc::QKNormRotary m(posenc::QKNormRotaryOptions(16));
  m->to(torch::kDouble);
  m->options.eps(0.5).weight_offset(1.0);
  const auto want = posenc::qk_norm_rope(q, k, m->q_norm->weight, m->k_norm->weight,
                                         posenc::QkNormRopeOptions().eps(0.5).weight_offset(1.0));
  const auto got = m(q, k);
  EXPECT_TRUE(torch::equal(std::get<0>(got), std::get<0>(want)));
  EXPECT_TRUE(torch::equal(std::get<1>(got), std::get<1>(want)));
  m->options.eps(-1.0);
  EXPECT_THROW(m(q, k), c10::ValueError);
  m->options.eps(1e-6).norm("hidden");  // weights of head_dim values do not fit norm "hidden"
  EXPECT_THROW(m(q, k), c10::Error);
  m->options.norm("layer");
  EXPECT_THROW(m(q, k), c10::ValueError);
}

TEST(QKNormRotaryModule, AGivenSeqLenIsReadWithTheParsedScaling) {
  // forward decided a given seq_len's argument from the live options: a "dynamic" module
  // whose options were edited to another type (no reset()) passed seq_len as 0, so the
  // parsed "dynamic" rotation never rescaled. Now the parsed scaling decides it.
  auto q = torch::randn({1, 4, 2, 16}, torch::kDouble), k = torch::randn({1, 4, 1, 16}, torch::kDouble);
  posenc::RopeScaling dynamic;
  dynamic.rope_type = "dynamic";
  dynamic.factor = 2.0;
  dynamic.original_max_position_embeddings = 8.0;
  posenc::QKNormRotary m(posenc::QKNormRotaryOptions(16).rope(posenc::ApplyRopeOptions().scaling(dynamic)));
  m->to(torch::kDouble);
  const auto at = posenc::RopePositions().offset(2).seq_len(64);
  const auto want = m(q, k, at);
  m->options.rope().scaling(posenc::RopeScaling());
  const auto got = m(q, k, at);
  EXPECT_TRUE(torch::equal(std::get<0>(got), std::get<0>(want)));
  EXPECT_TRUE(torch::equal(std::get<1>(got), std::get<1>(want)));
}

// An archive of another head_dim: refused, both weights left as they were (LibTorch's own
// load took a [16] weight into a module of head_dim 8, whose reset() then kept it).
// Weights resized by reset() are made on the module's device in its dtype (they were CPU
// float32 whatever to() had done: a float64 module then refused its own weights).
TEST(QKNormRotaryModule, ResizedWeightsFollowTheModulesDtype) {
  posenc::QKNormRotary m(posenc::QKNormRotaryOptions(8));
  m->to(torch::kDouble);
  m->options.norm("hidden").num_heads(3).num_kv_heads(1);  // k_norm keeps its size (8), q_norm grows
  m->reset();
  EXPECT_EQ(m->q_norm->weight.scalar_type(), torch::kDouble);
  EXPECT_EQ(m->k_norm->weight.scalar_type(), torch::kDouble);
  EXPECT_EQ(m->q_norm->weight.numel(), 24);
  auto q = torch::randn({1, 2, 3, 8}, torch::kDouble), k = torch::randn({1, 2, 1, 8}, torch::kDouble);
  EXPECT_EQ(std::get<0>(m(q, k)).scalar_type(), torch::kDouble);
  // A count that is missing or not positive is named with its value.
  for (auto [heads, kv_heads, named] : {std::tuple<int64_t, int64_t, const char*>{0, 1, "expected num_heads > 0"},
                                        {3, -2, "expected num_kv_heads > 0"}}) {
    m->options.num_heads(heads).num_kv_heads(kv_heads);
    try {
      m->reset();
      ADD_FAILURE() << "num_heads " << heads << ", num_kv_heads " << kv_heads << " were taken";
    } catch (const c10::ValueError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(named), std::string::npos) << what;
      EXPECT_NE(what.find("got " + std::to_string(heads > 0 ? kv_heads : heads)), std::string::npos) << what;
    }
  }
}

// The weights are made in the default dtype, as Python's QKNormRotary makes them (they were
// float32 whatever it was: a float64 default then refused float64 q as mixed dtypes).
TEST(QKNormRotaryModule, WeightsTakeTheDefaultDtype) {
  struct DefaultDtype {  // restored however the block ends
    caffe2::TypeMeta saved = torch::get_default_dtype();
    ~DefaultDtype() { torch::set_default_dtype(saved); }
  };
  posenc::QKNormRotary m{nullptr};
  {
    DefaultDtype restore;
    torch::set_default_dtype(caffe2::TypeMeta::Make<double>());
    m = posenc::QKNormRotary(posenc::QKNormRotaryOptions(8));
  }
  EXPECT_EQ(m->q_norm->weight.scalar_type(), torch::kDouble);
  EXPECT_EQ(m->k_norm->weight.scalar_type(), torch::kDouble);
  auto q = torch::randn({1, 2, 3, 8}, torch::kDouble), k = torch::randn({1, 2, 1, 8}, torch::kDouble);
  EXPECT_EQ(std::get<0>(m(q, k)).scalar_type(), torch::kDouble);
  EXPECT_EQ(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8))->q_norm->weight.scalar_type(), torch::kFloat);
  std::ostringstream printed;
  printed << *m->q_norm;
  EXPECT_EQ(printed.str(), "posenc::QkNormWeight(8)");
}

TEST(QKNormRotaryModule, LoadRefusesWeightsOfOtherSizes) {
  const std::string path = ::testing::TempDir() + "posenc_qknorm_16.pt";
  posenc::QKNormRotary a(posenc::QKNormRotaryOptions(16));
  torch::save(a, path);
  posenc::QKNormRotary b(posenc::QKNormRotaryOptions(8));
  {
    torch::NoGradGuard no_grad;
    b->q_norm->weight.uniform_(0.5, 1.5);
  }
  const auto q_weight = b->q_norm->weight.clone(), k_weight = b->k_norm->weight.clone();
  try {
    torch::load(b, path);
    ADD_FAILURE() << "a wrongly sized archive was loaded";
  } catch (const c10::Error& e) {  // named by its path from the module
    EXPECT_NE(std::string(e.what()).find("size mismatch for q_norm.weight: copying a tensor with shape [16]"),
              std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(b->q_norm->weight, q_weight) && torch::equal(b->k_norm->weight, k_weight));
  auto q = torch::randn({1, 3, 2, 8}), k = torch::randn({1, 3, 1, 8});
  EXPECT_EQ(std::get<0>(b(q, k)).sizes(), q.sizes());
  // The same head_dim loads.
  posenc::QKNormRotary c(posenc::QKNormRotaryOptions(16));
  torch::load(c, path);
  std::remove(path.c_str());
  EXPECT_TRUE(torch::equal(c->q_norm->weight, a->q_norm->weight));
}

// The norm's defaults are stated in the schemas (kQkNormSchemaSettings), in QkNormRopeCall's
// fields and in the C++ API's options: each reads as the schema's.
#include <ATen/core/dispatch/Dispatcher.h>

#include "ops/qk_norm_rope/qk_norm_rope.h"

TEST(QkNormRope, TheDefaultsOfTheCallAndOfTheOptionsAreTheSchemas) {
  for (const char* op : {"posenc::qk_norm_rope", "posenc::rope_append_kv"}) {
    const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow(op, "").schema();
    const auto default_of = [&](const char* name) {
      const auto index = schema.argumentIndexWithName(name);
      EXPECT_TRUE(index.has_value()) << op << ": " << name;
      return *schema.arguments().at(*index).default_value();
    };
    const posenc::ops::QkNormRopeCall call;
    const posenc::QkNormRopeOptions options;
    const posenc::QKNormRotaryOptions module(8);
    for (const double eps : {call.eps, options.eps(), module.eps()}) EXPECT_EQ(eps, default_of("eps").toDouble()) << op;
    for (const double w : {call.weight_offset, options.weight_offset(), module.weight_offset()}) {
      EXPECT_EQ(w, default_of("weight_offset").toDouble()) << op;
    }
    const std::string norm = default_of("norm").toStringRef();
    EXPECT_EQ(posenc::ops::qk_norm_name(call.norm), norm) << op;
    EXPECT_EQ(options.norm(), norm) << op;
    EXPECT_EQ(module.norm(), norm) << op;
  }
}

// Heads of another width than the module's head_dim: a ValueError. norm="hidden" weights
// (heads * head_dim values) also fit 4 heads of 128 where the module was built for 8 of 64,
// which rotated them with other frequencies and pairs.
TEST(QKNormRotaryModule, HeadsOfAnotherWidthAreRefused) {
  posenc::QKNormRotary hidden(posenc::QKNormRotaryOptions(64).norm("hidden").num_heads(8).num_kv_heads(2));
  try {
    hidden(torch::randn({1, 3, 4, 128}), torch::randn({1, 3, 1, 128}));
    ADD_FAILURE() << "heads of 128 features went through a module of head_dim 64";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("expected q and k with head_dim 64"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::get<0>(hidden(torch::randn({1, 3, 8, 64}), torch::randn({1, 3, 2, 64}))).size(3), 64);
  // Head counts given where norm="head" does not read them are checked too, as in Python.
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(16).num_heads(-3)), c10::ValueError);
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(16).num_kv_heads(0)), c10::ValueError);
}
