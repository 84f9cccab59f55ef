// GoogleTest: the shared math headers and the functional ops against C++ references
// written here from the formulas, in double precision.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "ops/common/op_handles.h"
#include "posenc/math/philox.h"
#include "posenc/posenc.h"

namespace {

// Reference table: PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(same).
torch::Tensor reference_table(const torch::Tensor& positions, int64_t d, double base) {
  auto pos = positions.to(torch::kDouble).contiguous();
  auto out = torch::empty({pos.numel(), d}, torch::kDouble);
  auto acc = out.accessor<double, 2>();
  const double* p = pos.data_ptr<double>();
  for (int64_t r = 0; r < pos.numel(); ++r) {
    for (int64_t j = 0; j < d; ++j) {
      const double angle = p[r] / std::pow(base, static_cast<double>(2 * (j / 2)) / d);
      acc[r][j] = j % 2 == 0 ? std::sin(angle) : std::cos(angle);
    }
  }
  auto shape = positions.sizes().vec();
  shape.push_back(d);
  return out.reshape(shape);
}

TEST(Philox, KnownAnswerVectors) {
  // Known-answer tests of Philox4x32-10 published with Random123.
  auto zero = posenc::math::philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(zero.v[0], 0x6627e8d5u);
  EXPECT_EQ(zero.v[1], 0xe169c58du);
  EXPECT_EQ(zero.v[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.v[3], 0x9b00dbd8u);
  auto ones = posenc::math::philox4x32_10(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu,
                                          0xffffffffu, 0xffffffffu);
  EXPECT_EQ(ones.v[0], 0x408f276du);
  EXPECT_EQ(ones.v[1], 0x41c83b0eu);
  EXPECT_EQ(ones.v[2], 0xa20bc7c6u);
  EXPECT_EQ(ones.v[3], 0x6d5451fdu);
}

TEST(DropoutParams, ThresholdAndScale) {
  auto half = posenc::math::make_dropout_params(0.5);
  EXPECT_EQ(half.threshold, 32768u);
  EXPECT_EQ(posenc::math::dropout_scale<double>(half.keep_prob), 2.0);
  EXPECT_EQ(posenc::math::dropout_scale<float>(half.keep_prob), 2.0f);
  auto all = posenc::math::make_dropout_params(1.0);
  EXPECT_EQ(all.threshold, 65536u);
  EXPECT_EQ(posenc::math::dropout_scale<float>(all.keep_prob), 0.0f);
  EXPECT_EQ(posenc::math::dropout_scale<double>(all.keep_prob), 0.0);
  EXPECT_EQ(posenc::math::make_dropout_params(0.0).threshold, 0u);
  // ATen's nn.Dropout: 1 - p rounded to the dtype, one division in it (float32 at p = 0.15:
  // 1.1764705181, where 1 / 0.85 rounded from float64 is 1.1764706373).
  const auto p15 = posenc::math::make_dropout_params(0.15);
  EXPECT_EQ(posenc::math::dropout_scale<float>(p15.keep_prob), 1.0f / static_cast<float>(1.0 - 0.15));
  EXPECT_NE(posenc::math::dropout_scale<float>(p15.keep_prob), static_cast<float>(1.0 / (1.0 - 0.15)));
  EXPECT_EQ(posenc::math::dropout_scale<double>(p15.keep_prob), 1.0 / (1.0 - 0.15));
}

TEST(DropoutMask, CpuKernelDrawsTheSharedScalarBits) {
  // The CPU kernel runs Philox over 8 counters in SIMD lanes; every element must still
  // get exactly the bits of the scalar header function (which the CUDA kernel uses).
  const uint64_t seed = 0x0123456789ABCDEFull, offset = 4242;
  const double p = 0.3;
  const auto params = posenc::math::make_dropout_params(p);
  const auto rng = torch::tensor({static_cast<int64_t>(seed), static_cast<int64_t>(offset)});
  // float32 and bfloat16 take the fused AVX-512 pass on CPUs that have it (groups of 128 and
  // 512 elements), float64 the 16-lane Philox of dropout_bits (groups of 16 and 64 blocks).
  for (const auto dtype : {torch::kDouble, torch::kFloat, torch::kBFloat16}) {
    for (int64_t n : {1, 7, 8, 9, 63, 64, 65, 127, 128, 129, 511, 512, 513, 1023, 1024, 1025, 5000}) {
      const auto grad = torch::ones({n}, dtype);
      const auto got = posenc::ops::add_position_backward_op().call(grad, rng, p);
      auto want = torch::empty({n}, torch::kDouble);
      for (int64_t e = 0; e < n; ++e) {
        const auto bits = posenc::math::dropout_block_bits(seed, offset, e / 8);
        const bool keep = posenc::math::dropout_lane_bits(bits, static_cast<int>(e % 8)) >= params.threshold;
        // The kept value: the scale in the compute dtype, times 1, rounded once to the dtype.
        want[e] = !keep ? 0.0
                  : dtype == torch::kDouble
                      ? posenc::math::dropout_scale<double>(params.keep_prob)
                      : static_cast<double>(posenc::math::dropout_scale<float>(params.keep_prob));
      }
      ASSERT_TRUE(torch::equal(got, want.to(dtype))) << "n=" << n << " " << dtype;
    }
  }
}

TEST(SinusoidalTable, MatchesReferenceAtIntegerAndFloatPositions) {
  for (int64_t d : {1, 2, 7, 64, 129}) {
    auto pos = torch::randint(0, 6000, {3, 5}, torch::kLong);
    auto got = posenc::sinusoidal_table(pos, d, 10000.0, torch::kDouble);
    auto want = reference_table(pos, d, 10000.0);
    ASSERT_EQ(got.sizes(), want.sizes());
    EXPECT_LT((got - want).abs().max().item<double>(), 1e-12) << "d=" << d;
    auto fpos = torch::rand({11}, torch::kDouble) * 300.0;
    auto got_f = posenc::sinusoidal_table(fpos, d, 500.0);
    EXPECT_EQ(got_f.scalar_type(), torch::kFloat);
    EXPECT_LT((got_f.to(torch::kDouble) - reference_table(fpos, d, 500.0)).abs().max().item<double>(),
              1e-7);
  }
}

TEST(SinusoidalTable, EachTableDtypeAndATypeErrorForOthers) {
  auto pos = torch::arange(40, torch::kLong);
  auto wide = posenc::sinusoidal_table(pos, 10, 10000.0, torch::kDouble);
  for (auto t : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    auto got = posenc::sinusoidal_table(pos, 10, 10000.0, t);
    EXPECT_EQ(got.scalar_type(), t);
    EXPECT_TRUE(torch::equal(got, wide.to(t))) << t;  // one rounding of the float64 table
  }
  try {
    posenc::sinusoidal_table(pos, 10, 10000.0, torch::kInt);
    FAIL() << "expected a TypeError";
  } catch (const c10::TypeError& e) {
    EXPECT_NE(std::string(e.what()).find("got 'int32'"), std::string::npos) << e.what();
  }
}

TEST(AddPosition, MatchesReferenceBothLayouts) {
  for (bool batch_first : {true, false}) {
    auto x = torch::randn({3, 5, 6}, torch::kDouble);
    auto table = torch::randn({1, 20, 6}, torch::kDouble);
    const int64_t seq = batch_first ? 5 : 3;
    auto rows = table[0].slice(0, 4, 4 + seq);
    auto want = batch_first ? x + rows.unsqueeze(0) : x + rows.unsqueeze(1);
    auto got = posenc::add_position(x, table, std::nullopt, 4, batch_first, 0.0);
    EXPECT_TRUE(torch::equal(got, want));
  }
}

TEST(AddPosition, DropoutRegeneratesTheMaskInBackward) {
  auto x = torch::randn({4, 33, 10}, torch::requires_grad(true).dtype(torch::kDouble));
  auto table = torch::randn({40, 10}, torch::kDouble);
  torch::manual_seed(7);
  auto y = posenc::add_position(x, table, std::nullopt, 0, true, 0.3);
  auto g = torch::randn_like(y);
  y.backward(g);
  auto base = x.detach() + table.slice(0, 0, 33).unsqueeze(0);
  auto kept = y.detach() != 0;
  // Survivors are exactly scaled, dropped ones are zero, and the gradient follows the mask.
  EXPECT_TRUE(torch::allclose(y.detach().masked_select(kept), (base * (1.0 / 0.7)).masked_select(kept),
                              0, 0));
  EXPECT_TRUE(torch::equal(x.grad(), torch::where(kept, g * (1.0 / 0.7), torch::zeros_like(g))));
  const double frac = 1.0 - kept.to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(frac, 0.3, 4 * std::sqrt(0.3 * 0.7 / kept.numel()));
  // Same seed, same mask.
  torch::manual_seed(7);
  auto y2 = posenc::add_position(x.detach(), table, std::nullopt, 0, true, 0.3);
  EXPECT_TRUE(torch::equal(y.detach(), y2));
}

TEST(AddPosition, SavedCpuMaskGivesTheRegeneratedMasksGradients) {
  // CPU autograd saves the keep mask as bits (save_mask=True); its backward must equal the
  // one that regenerates the mask from the key, bit for bit, for x and for the table.
  for (int64_t d : {5, 16, 1031}) {
    const auto x = torch::randn({3, 9, d});
    const auto table = torch::randn({12, d});
    const auto pos = torch::randint(0, 3, {3, 9}, torch::kLong);
    torch::manual_seed(11);
    auto [out_key, key] = posenc::ops::add_position_forward_op().call(x, table, pos, 0, true, 0.3, false);
    torch::manual_seed(11);
    auto [out_mask, mask] = posenc::ops::add_position_forward_op().call(x, table, pos, 0, true, 0.3, true);
    ASSERT_TRUE(torch::equal(out_key, out_mask)) << "d=" << d;
    ASSERT_EQ(mask.scalar_type(), torch::kByte);
    ASSERT_EQ(mask.sizes(), (std::vector<int64_t>{3, 9, (d + 7) / 8}));
    const auto g = torch::randn({3, 9, d});
    EXPECT_TRUE(torch::equal(posenc::ops::add_position_backward_op().call(g, key, 0.3),
                             posenc::ops::add_position_backward_op().call(g, mask, 0.3)));
    auto [gx_key, gt_key] = posenc::ops::add_position_backward_with_table_op().call(
        g, key, pos, 0, true, 0.3, 12, true, std::nullopt);
    auto [gx_mask, gt_mask] = posenc::ops::add_position_backward_with_table_op().call(
        g, mask, pos, 0, true, 0.3, 12, true, std::nullopt);
    EXPECT_TRUE(torch::equal(gx_key, gx_mask) && torch::equal(gt_key, gt_mask)) << "d=" << d;
    // The C++ module API's gradients come from the saved mask: equal to the key path's.
    const auto xg = x.clone().requires_grad_(true);
    const auto tg = table.clone().requires_grad_(true);
    torch::manual_seed(11);
    posenc::add_position(xg, tg, pos, 0, true, 0.3).backward(g);
    EXPECT_TRUE(torch::equal(xg.grad(), gx_key) && torch::equal(tg.grad(), gt_key)) << "d=" << d;
  }
}

TEST(AddPosition, TableGradientSumsOverRepeatedPositions) {
  auto x = torch::randn({3, 6, 4}, torch::requires_grad(true).dtype(torch::kDouble));
  auto table = torch::randn({1, 9, 4}, torch::requires_grad(true).dtype(torch::kDouble));
  auto pos = torch::randint(0, 3, {3, 6}, torch::kLong);  // many repeats
  auto g = torch::randn({3, 6, 4}, torch::kDouble);
  posenc::add_position(x, table, pos).backward(g);
  auto want = torch::zeros({9, 4}, torch::kDouble).index_add_(0, pos.reshape(-1), g.reshape({-1, 4}));
  EXPECT_TRUE(torch::allclose(table.grad().squeeze(0), want, 1e-12, 1e-12));
  EXPECT_TRUE(torch::equal(x.grad(), g));
}

TEST(AddPosition, RejectsBadInput) {
  auto table = torch::randn({8, 4});
  EXPECT_THROW(posenc::add_position(torch::randn({2, 4}), table), c10::Error);
  EXPECT_THROW(posenc::add_position(torch::randn({2, 3, 5}), table), c10::Error);
  EXPECT_THROW(posenc::add_position(torch::randn({2, 9, 4}), table), c10::Error);
  EXPECT_THROW(posenc::add_position(torch::randn({2, 3, 4}), table, std::nullopt, 0, true, 1.5),
               c10::Error);
  EXPECT_THROW(posenc::add_position(torch::randn({2, 3, 4}), table, torch::tensor({0, 1, 8})),
               c10::IndexError);
}

}  // namespace

// An undefined tensor (torch::Tensor()) where the C++ API takes an optional one is absent, as
// ATen's C++ functions read it: each call equals the call without it (before, the op saw a
// tensor of shape [0] and dtype UNKNOWN_SCALAR and refused it with a message about that).
TEST(CppApi, UndefinedOptionalTensorsAreAbsent) {
  torch::manual_seed(0);
  const auto q = torch::randn({1, 4, 2, 8}), k = torch::randn({1, 4, 2, 8});
  const torch::Tensor none;
  auto [q1, k1] = posenc::apply_rope(q, k);
  for (const auto& o : {posenc::ApplyRopeOptions().positions(none), posenc::ApplyRopeOptions().offsets(none),
                        posenc::ApplyRopeOptions().cu_seqlens(none)}) {
    auto [q2, k2] = posenc::apply_rope(q, k, o);
    EXPECT_TRUE(torch::equal(q2, q1) && torch::equal(k2, k1));
  }
  // k undefined: q alone, the second output undefined (as the module's forward).
  auto [q3, k3] = posenc::apply_rope(q, none);
  EXPECT_TRUE(torch::equal(q3, q1));
  EXPECT_FALSE(k3.defined());
  auto q4 = q.clone();
  posenc::apply_rope_(q4, none);
  EXPECT_TRUE(torch::equal(q4, q1));

  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8));
  auto [q5, k5] = rope(q, k, none);
  EXPECT_TRUE(torch::equal(q5, q1) && torch::equal(k5, k1));

  const auto x = torch::randn({2, 4, 8}), table = torch::randn({10, 8});
  EXPECT_TRUE(torch::equal(posenc::add_position(x, table, none), posenc::add_position(x, table)));
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(8).dropout(0.0));
  EXPECT_TRUE(torch::equal(pe(x, 0, none), pe(x)));

  auto kc = torch::zeros({1, 8, 2, 8}), vc = torch::zeros({1, 8, 2, 8});
  auto kc2 = kc.clone(), vc2 = vc.clone();
  auto [qa, unused_a] =
      posenc::rope_append_kv(q, k, k, kc, vc, posenc::RopeAppendKvOptions().slot_mapping(none).k_scale(none));
  auto [qb, unused_b] = posenc::rope_append_kv(q, k, k, kc2, vc2);
  EXPECT_TRUE(torch::equal(qa, qb) && torch::equal(kc, kc2) && torch::equal(vc, vc2));

  auto cache = torch::randn({1, 8, 2, 8});
  auto cache2 = cache.clone();
  const auto from = torch::arange(4, 6), to = torch::arange(2, 4), rows = torch::arange(4, 6);
  posenc::rope_shift_kv_(cache, from, to, posenc::RopeShiftKvOptions().rows(rows).slot_mapping(none).k_scale(none));
  posenc::rope_shift_kv_(cache2, from, to, posenc::RopeShiftKvOptions().rows(rows));
  EXPECT_TRUE(torch::equal(cache, cache2));

  // Where k is required (qk_norm_rope, rope_append_kv), an undefined one is a ValueError
  // naming k, not a None the kernels would dereference (a crash, found by a review).
  const auto w = torch::ones({8});
  EXPECT_THROW(posenc::qk_norm_rope(q, none, w, w), c10::ValueError);
  posenc::QKNormRotary qkn(posenc::QKNormRotaryOptions(8));
  EXPECT_THROW(qkn(q, none), c10::ValueError);
  EXPECT_THROW(posenc::rope_append_kv(q, none, k, kc, vc), c10::ValueError);
  EXPECT_THROW(posenc::rope_append_kv_(q.clone(), none, k, kc, vc), c10::ValueError);
  for (int i = 0; i < 3; ++i) {  // rope_shift_kv_'s required tensors, each named (k_cache was "q")
    const char* names[] = {"k_cache", "from_positions", "to_positions"};
    torch::Tensor args[] = {cache.clone(), from, to};
    args[i] = none;
    try {
      posenc::rope_shift_kv_(args[0], args[1], args[2], posenc::RopeShiftKvOptions().rows(rows));
      ADD_FAILURE() << names[i];
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("expected ") + names[i] + " to be a tensor"),
                std::string::npos) << e.what();
    }
  }
  try {
    posenc::rope_append_kv(q, none, k, kc, vc);
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("expected k to be a tensor"), std::string::npos) << e.what();
  }
}

// Integer arguments whose products or sums would wrap are refused (a fuzz of the C++ API
// found a silent wrong size and silent negative positions).
TEST(CppApi, OverflowingSizesAndPositionsAreRefused) {
  const auto tokens = torch::tensor({{1L, 5L, 6L}});
  const int64_t two62 = int64_t{1} << 62;
  EXPECT_THROW(posenc::make_positions(tokens, two62, two62), c10::ValueError);
  const int64_t last = std::numeric_limits<int64_t>::max();
  EXPECT_THROW(posenc::make_positions(tokens, two62, last - two62 - 2), c10::ValueError);
  const auto ok = posenc::make_positions(tokens, two62, last - two62 - 3);  // the largest that fits
  EXPECT_EQ(ok.max().item<int64_t>(), last);
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8).norm("hidden").num_heads((int64_t{1} << 61) + 4)
                                        .num_kv_heads(2)),
               c10::ValueError);
  EXPECT_THROW(posenc::QKNormRotary(posenc::QKNormRotaryOptions(8).norm("hidden").num_heads(2)
                                        .num_kv_heads(int64_t{1} << 61)),
               c10::ValueError);
}

namespace {

// An op called boxed by name: the arguments given by name, every other one its schema default
// (as torch.ops.posenc.<name>(...) from Python, or a C++ caller of the dispatcher).
torch::jit::Stack call_boxed(const char* name, const char* overload,
                             const std::map<std::string, c10::IValue>& given) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  torch::jit::Stack stack;
  for (const auto& a : op.schema().arguments()) {
    const auto it = given.find(a.name());
    if (it != given.end()) {
      stack.push_back(it->second);
    } else {
      EXPECT_TRUE(a.default_value().has_value()) << name << ": " << a.name();
      stack.push_back(a.default_value().value_or(c10::IValue()));
    }
  }
  op.callBoxed(&stack);
  return stack;
}

// Every tensor a boxed call returned and every tensor it was given (the in-place ops' results),
// cloned.
std::vector<torch::Tensor> tensors_of(const torch::jit::Stack& returned,
                                      const std::map<std::string, c10::IValue>& given) {
  std::vector<torch::Tensor> out;
  for (const auto& v : returned) {
    if (v.isTensor() && v.toTensor().defined()) out.push_back(v.toTensor().clone());
  }
  for (const auto& [name, v] : given) {
    if (v.isTensor() && v.toTensor().defined()) out.push_back(v.toTensor().clone());
  }
  return out;
}

}  // namespace

// A direct dispatcher call (no C++ API in between) with an undefined tensor where the schema
// takes an optional tensor reads it as None, for every op and every such argument, as
// ATen's ops do (the RoPE ops' index tensors refused it while the KV-cache ops' own optional
// arguments took it as None). Required tensors stay refused by name (CppApi test above).
TEST(Dispatcher, UndefinedOptionalTensorIsNone) {
  torch::manual_seed(0);
  const auto q = torch::randn({1, 4, 2, 8}), k = torch::randn({1, 4, 2, 8});
  const auto x = torch::randn({2, 4, 8}), table = torch::randn({10, 8});
  const auto w = torch::ones({8});
  const auto cos = torch::randn({4, 8}), sin = torch::randn({4, 8}), cache = torch::randn({2, 8, 2, 8});
  struct Case {
    const char* name;
    const char* overload;
    std::function<std::map<std::string, c10::IValue>()> args;  // fresh inputs (in-place ops)
    std::vector<std::string> optional;
  };
  const std::vector<std::string> index = {"positions", "offsets", "cu_seqlens"};
  auto with = [](std::vector<std::string> a, std::vector<std::string> b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<Case> cases = {
      {"posenc::add_position", "", [&] { return std::map<std::string, c10::IValue>{{"x", x}, {"table", table}}; },
       {"positions"}},
      {"posenc::add_position_forward", "",
       [&] {
         return std::map<std::string, c10::IValue>{{"x", x}, {"table", table}, {"positions", c10::IValue()},
                                                   {"offset", c10::SymInt(0)}, {"batch_first", true}, {"p", 0.0}};
       },
       {"positions"}},
      {"posenc::apply_rope_cos_sin", "",
       [&] {
         return std::map<std::string, c10::IValue>{
             {"q", q}, {"k", k}, {"cos", cos}, {"sin", sin}, {"layout", std::string("bshd")}};
       },
       {"k"}},
      {"posenc::rope", "", [&] { return std::map<std::string, c10::IValue>{{"q", q}, {"k", k}}; },
       with({"k"}, index)},
      {"posenc::rope_", "", [&] { return std::map<std::string, c10::IValue>{{"q", q.clone()}, {"k", k.clone()}}; },
       with({"k"}, index)},
      {"posenc::rope_position_bounds", "", [&] { return std::map<std::string, c10::IValue>{{"q", q}}; },
       with({"k"}, index)},
      {"posenc::rope_position_extremes", "", [&] { return std::map<std::string, c10::IValue>{{"q", q}}; },
       with({"k"}, index)},
      {"posenc::qk_norm_rope", "",
       [&] { return std::map<std::string, c10::IValue>{{"q", q}, {"k", k}, {"q_weight", w}, {"k_weight", w}}; },
       index},
      {"posenc::rope_append_kv", "",
       [&] {
         return std::map<std::string, c10::IValue>{
             {"q", q}, {"k", k}, {"v", k}, {"k_cache", torch::zeros({1, 8, 2, 8})},
             {"v_cache", torch::zeros({1, 8, 2, 8})}};
       },
       with({"slot_mapping", "k_scale", "v_scale", "q_weight", "k_weight"}, index)},
      {"posenc::rope_append_kv_", "keep_k",
       [&] {
         return std::map<std::string, c10::IValue>{
             {"q", q.clone()}, {"k", k}, {"v", k}, {"k_cache", torch::zeros({1, 8, 2, 8})},
             {"v_cache", torch::zeros({1, 8, 2, 8})}};
       },
       with({"slot_mapping", "k_scale", "v_scale", "q_weight", "k_weight"}, index)},
      {"posenc::rope_shift_kv_", "",
       [&] {
         return std::map<std::string, c10::IValue>{{"k_cache", cache.clone()},
                                                   {"from_positions", torch::arange(4, 6)},
                                                   {"to_positions", torch::arange(2, 4)}};
       },
       {"rows", "slot_mapping", "k_scale"}},
  };
  for (const auto& c : cases) {
    for (const auto& name : c.optional) {
      auto absent = c.args(), undefined = c.args();
      absent[name] = c10::IValue();
      undefined[name] = torch::Tensor();
      const auto want = tensors_of(call_boxed(c.name, c.overload, absent), absent);
      std::vector<torch::Tensor> got;
      EXPECT_NO_THROW(got = tensors_of(call_boxed(c.name, c.overload, undefined), undefined))
          << c.name << " " << name;
      ASSERT_EQ(got.size(), want.size()) << c.name << " " << name;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(got[i].scalar_type() == want[i].scalar_type() && torch::equal(got[i], want[i]))
            << c.name << " " << name;
      }
    }
  }
}
