// GoogleTest: posenc::RotaryPositionalEncoding, apply_rope and the shared RoPE math.
#include <gtest/gtest.h>
#include <sstream>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <variant>
#include <optional>
#include <string>
#include <thread>

#include "posenc/math/rope.h"
#include "posenc/posenc.h"

namespace {

// Hugging Face's rotate_half formulation in float64, written from the formula.
torch::Tensor reference_neox(const torch::Tensor& x, const torch::Tensor& pos, double base) {
  const int64_t d = x.size(-1);
  auto inv = 1.0 / torch::pow(torch::tensor(base, torch::kDouble),
                              torch::arange(0, d, 2, torch::kDouble) / static_cast<double>(d));
  auto angle = pos.to(torch::kDouble).unsqueeze(-1) * inv;  // (B, S, d/2)
  auto emb = torch::cat({angle, angle}, -1).unsqueeze(2);
  auto xd = x.to(torch::kDouble);
  auto rotated = torch::cat({-xd.slice(-1, d / 2), xd.slice(-1, 0, d / 2)}, -1);
  return xd * emb.cos() + rotated * emb.sin();
}

TEST(RopeMath, SincosIsAccurateAtLongPositions) {
  for (int64_t pos : {int64_t{0}, int64_t{1}, int64_t{12345}, int64_t{1} << 20, int64_t{1} << 40}) {
    for (double inv : {1.0, 0.3, 1e-4}) {
      float s = 0, c = 0;
      posenc::math::rope_sincos<float>(pos, inv, &s, &c);
      const long double angle = static_cast<long double>(pos) * inv;
      EXPECT_NEAR(s, static_cast<double>(std::sin(angle)), 2e-7) << pos << " " << inv;
      EXPECT_NEAR(c, static_cast<double>(std::cos(angle)), 2e-7) << pos << " " << inv;
    }
  }
}

TEST(RopeMath, SequenceOfToken) {
  const int64_t cu[] = {0, 3, 3, 7};
  EXPECT_EQ(posenc::math::rope_sequence_of(cu, 3, 0), 0);
  EXPECT_EQ(posenc::math::rope_sequence_of(cu, 3, 2), 0);
  EXPECT_EQ(posenc::math::rope_sequence_of(cu, 3, 3), 2);  // the empty sequence is skipped
  EXPECT_EQ(posenc::math::rope_sequence_of(cu, 3, 6), 2);
  EXPECT_EQ(posenc::math::rope_sequence_of(cu, 3, 7), -1);
  EXPECT_EQ(posenc::math::rope_sequence_of(cu, 3, -1), -1);
}

TEST(RotaryModule, ForwardMatchesReferenceWithGqaAndOffset) {
  torch::manual_seed(0);
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(16).max_len(64));
  auto q = torch::randn({2, 7, 4, 16}, torch::kDouble);
  auto k = torch::randn({2, 7, 2, 16}, torch::kDouble);
  auto [oq, ok] = rope(q, k, std::nullopt, 5);
  auto pos = (torch::arange(7, torch::kLong) + 5).expand({2, 7});
  EXPECT_TRUE(torch::allclose(oq, reference_neox(q, pos, 10000.0), 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(ok, reference_neox(k, pos, 10000.0), 1e-12, 1e-12));
  EXPECT_EQ(rope->parameters().size(), 0u);
  EXPECT_EQ(rope->buffers().size(), 0u);
  EXPECT_EQ(rope->inv_freq().size(0), 8);
}

TEST(RotaryModule, PositionsBeyondMaxLenRaise) {
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8).max_len(10));
  auto q = torch::randn({1, 4, 1, 8});
  EXPECT_THROW(rope(q, q, std::nullopt, 7), c10::IndexError);
  EXPECT_THROW(rope(q, q, torch::tensor({0, 1, 2, 10}, torch::kLong)), c10::IndexError);
  EXPECT_NO_THROW(rope(q, q, std::nullopt, 6));
  EXPECT_THROW(posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(8).rotary_dim(5)),
               c10::ValueError);
  // q or k of another head_dim than the module's dim.
  auto wide = torch::randn({1, 4, 1, 10});
  EXPECT_THROW(rope(wide, wide), c10::ValueError);
  EXPECT_THROW(rope(q, wide), c10::ValueError);
}

TEST(RotaryModule, ForwardAtTakesPerRowOffsetsAndPackedSequences) {
  torch::manual_seed(1);
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8).max_len(32));
  auto q = torch::randn({2, 3, 2, 8}, torch::kDouble);
  auto k = torch::randn({2, 3, 1, 8}, torch::kDouble);
  // Row 0 holds 29..31, row 1 holds 0..2: inside max_len, though the two ends summed are not.
  auto positions = torch::tensor({29, 30, 31, 0, 1, 2}, torch::kLong).reshape({2, 3});
  auto offsets = torch::tensor({0, 0}, torch::kLong);
  auto [oq, ok] = rope->forward_at(q, k, posenc::RopePositions().positions(positions).offsets(offsets));
  EXPECT_TRUE(torch::allclose(oq, reference_neox(q, positions, 10000.0), 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(ok, reference_neox(k, positions, 10000.0), 1e-12, 1e-12));
  EXPECT_THROW(rope->forward_at(q, k, posenc::RopePositions().offsets(torch::tensor({0, 30}, torch::kLong))),
               c10::IndexError);

  // Packed: sequences of 2 and 3 tokens (and an empty one with a far offset) at offsets 4, 27.
  posenc::RotaryPositionalEncoding packed(
      posenc::RotaryPositionalEncodingOptions(8).max_len(32).layout("thd"));
  auto qt = torch::randn({5, 2, 8}, torch::kDouble);
  auto cu = torch::tensor({0, 2, 2, 5}, torch::kInt);
  auto where = posenc::RopePositions().cu_seqlens(cu).offsets(torch::tensor({4, 500, 27}, torch::kLong));
  auto [pq, pk] = packed->forward_at(qt, qt, where);
  auto pos = torch::tensor({4, 5, 27, 28, 29}, torch::kLong).unsqueeze(0);
  EXPECT_TRUE(torch::allclose(pq, reference_neox(qt.unsqueeze(0), pos, 10000.0).squeeze(0), 1e-12, 1e-12));
  EXPECT_THROW(packed->forward_at(qt, qt, where.offset(3)), c10::IndexError);  // 30..32
}

TEST(RotaryModule, DynamicWithTensorPositionsMatchesTheFunction) {
  // The module hands the longest position it read for its range check to the op; the
  // numbers must be those the op gets when it reads the positions itself.
  posenc::RopeScaling dynamic;
  dynamic.rope_type = "dynamic";
  dynamic.factor = 2.0;
  dynamic.original_max_position_embeddings = 16;
  posenc::RotaryPositionalEncoding rope(
      posenc::RotaryPositionalEncodingOptions(8).max_len(64).scaling(dynamic));
  auto q = torch::randn({2, 5, 1, 8}, torch::kDouble);
  auto positions = torch::tensor({0, 3, 9, 2, 40, 1, 1, 7, 50, 6}, torch::kLong).reshape({2, 5});
  auto [oq, ok] = rope(q, q, positions);
  auto want = posenc::apply_rope(q, posenc::ApplyRopeOptions().positions(positions).scaling(dynamic));
  EXPECT_TRUE(torch::allclose(oq, want, 1e-12, 1e-12));
  auto unscaled = posenc::apply_rope(q, posenc::ApplyRopeOptions().positions(positions));
  EXPECT_FALSE(torch::allclose(oq, unscaled, 1e-6, 1e-6));
}

TEST(RotaryModule, AnIntOffsetIsRangeCheckedOnEveryLayoutsSequenceAxis) {
  // The decode step's call (no index tensor) checks offset .. offset + seq - 1 arithmetically.
  auto q = torch::randn({2, 3, 2, 8}, torch::kDouble);
  posenc::RotaryPositionalEncoding bshd(posenc::RotaryPositionalEncodingOptions(8).max_len(10));
  EXPECT_NO_THROW(bshd(q, q, std::nullopt, 7));  // positions 7, 8, 9
  EXPECT_THROW(bshd(q, q, std::nullopt, 8), c10::IndexError);
  EXPECT_THROW(bshd(q, q, std::nullopt, -1), c10::IndexError);
  auto no_tokens = torch::randn({2, 0, 2, 8});
  EXPECT_NO_THROW(bshd(no_tokens, no_tokens, std::nullopt, 50));  // no token, no bound
  posenc::RotaryPositionalEncoding bhsd(posenc::RotaryPositionalEncodingOptions(8).max_len(10).layout("bhsd"));
  auto q_bhsd = torch::randn({1, 2, 3, 8});  // seq is dim 2
  EXPECT_NO_THROW(bhsd(q_bhsd, q_bhsd, std::nullopt, 7));
  EXPECT_THROW(bhsd(q_bhsd, q_bhsd, std::nullopt, 8), c10::IndexError);
  posenc::RotaryPositionalEncoding sbhd(posenc::RotaryPositionalEncodingOptions(8).max_len(10).layout("sbhd"));
  auto q_sbhd = torch::randn({3, 1, 2, 8});  // seq is dim 0
  EXPECT_NO_THROW(sbhd(q_sbhd, q_sbhd, std::nullopt, 7));
  EXPECT_THROW(sbhd(q_sbhd, q_sbhd, std::nullopt, 8), c10::IndexError);
  // "dynamic" scales by the longest position, offset + seq - 1, as with explicit positions.
  posenc::RopeScaling dynamic;
  dynamic.rope_type = "dynamic";
  dynamic.factor = 2.0;
  dynamic.original_max_position_embeddings = 16;
  posenc::RotaryPositionalEncoding scaled(posenc::RotaryPositionalEncodingOptions(8).max_len(64).scaling(dynamic));
  auto [at_offset, unused] = scaled(q, q, std::nullopt, 30);
  auto positions = torch::arange(30, 33, torch::kLong);
  auto want = posenc::apply_rope(q, posenc::ApplyRopeOptions().positions(positions).scaling(dynamic));
  EXPECT_TRUE(torch::allclose(at_offset, want, 1e-12, 1e-12));
}

TEST(RotaryModule, AnOffsetNearTheInt64LimitIsTheModulesIndexError) {
  // offset .. offset + seq - 1 past INT64_MAX: the range check must not overflow (it wrapped,
  // found no position out of range, and the op's ValueError about the offset followed).
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  auto q = torch::randn({2, 3, 2, 8});
  for (const int64_t max_len : {int64_t{10}, kMax}) {
    posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8).max_len(max_len));
    EXPECT_THROW(rope(q, q, std::nullopt, kMax - 1), c10::IndexError) << max_len;
    EXPECT_THROW(rope(q, q, std::nullopt, kMax), c10::IndexError) << max_len;
    EXPECT_THROW(rope(q, q, std::nullopt, kMax - 2), c10::IndexError) << max_len;  // last position kMax
  }
  try {
    posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8).max_len(10));
    rope(q, q, std::nullopt, kMax - 1);
    ADD_FAILURE() << "no error";
  } catch (const c10::IndexError& e) {
    EXPECT_NE(std::string(e.what()).find("max_len=10"), std::string::npos) << e.what();
  }
}

TEST(RotaryModule, GradientsAreTheInverseRotation) {
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(12).interleaved(true));
  auto q = torch::randn({2, 5, 3, 12}, torch::requires_grad(true).dtype(torch::kDouble));
  auto k = torch::randn({2, 5, 1, 12}, torch::requires_grad(true).dtype(torch::kDouble));
  auto pos = torch::randint(0, 4000, {2, 5}, torch::kLong);
  auto [oq, ok] = rope(q, k, pos);
  auto gq = torch::randn_like(oq), gk = torch::randn_like(ok);
  ((oq * gq).sum() + (ok * gk).sum()).backward();
  // Rotating the gradient forward again gives the incoming gradient back.
  auto opts = posenc::ApplyRopeOptions().positions(pos).interleaved(true);
  auto [bq, bk] = posenc::apply_rope(q.grad(), k.grad(), opts);
  EXPECT_TRUE(torch::allclose(bq, gq, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(bk, gk, 1e-12, 1e-12));
}

TEST(ApplyRope, ScalingLayoutsAndInPlace) {
  auto q = torch::randn({3, 2, 6, 8});  // bhsd
  posenc::RopeScaling llama3;
  llama3.rope_type = "llama3";
  llama3.factor = 8.0;
  llama3.low_freq_factor = 1.0;
  llama3.high_freq_factor = 4.0;
  llama3.original_max_position_embeddings = 16;
  auto opts = posenc::ApplyRopeOptions().layout("bhsd").scaling(llama3).offset(100);
  auto out = posenc::apply_rope(q, opts);
  auto copy = q.clone();
  posenc::apply_rope_(copy, std::nullopt, opts);
  EXPECT_TRUE(torch::equal(copy, out));
  auto [inv, factor] = posenc::rope_frequencies(8, 10000.0, llama3);
  EXPECT_EQ(factor, 1.0);
  // llama3's rule written out (transformers' _compute_llama3_parameters): wavelengths above
  // original / low_freq_factor are divided by factor, below original / high_freq_factor kept,
  // in between blended.
  auto want_inv = torch::empty({4}, torch::kDouble);
  for (int i = 0; i < 4; ++i) {
    const double f = std::pow(10000.0, -2.0 * i / 8.0), wavelen = 2 * M_PI / f;
    const double low_wavelen = 16.0 / 1.0, high_wavelen = 16.0 / 4.0;
    double v = f;
    if (wavelen > low_wavelen) {
      v = f / 8.0;
    } else if (wavelen >= high_wavelen) {
      const double smooth = (16.0 / wavelen - 1.0) / (4.0 - 1.0);
      v = (1 - smooth) * f / 8.0 + smooth * f;
    }
    want_inv[i] = v;
  }
  EXPECT_TRUE(torch::allclose(inv, want_inv, 1e-12, 0)) << inv << want_inv;
  // The rotation at positions 100 .. 105 (bhsd) with those frequencies, halves convention.
  auto angle = (torch::arange(100, 106, torch::kDouble).unsqueeze(-1) * want_inv);
  auto emb = torch::cat({angle, angle}, -1);  // (6, 8)
  auto qd = q.to(torch::kDouble);
  auto rotated = torch::cat({-qd.slice(-1, 4), qd.slice(-1, 0, 4)}, -1);
  auto want = qd * emb.cos() + rotated * emb.sin();
  EXPECT_TRUE(torch::allclose(out.to(torch::kDouble), want, 1e-5, 1e-5));
  posenc::RopeScaling bad;
  bad.rope_type = "ntk";
  EXPECT_THROW(posenc::apply_rope(q, posenc::ApplyRopeOptions().scaling(bad)), c10::ValueError);
  EXPECT_THROW(posenc::apply_rope(q, posenc::ApplyRopeOptions().layout("hsd")), c10::ValueError);
  // Lists for a type that reads none: a message that says so (was "expected 1 + 12 rope
  // scaling values ..., got 21", the op's flat list).
  posenc::RopeScaling yarn;
  yarn.rope_type = "yarn";
  yarn.factor = 2.0;
  yarn.short_factor = yarn.long_factor = {1.0, 1.0};
  try {
    posenc::apply_rope(q, posenc::ApplyRopeOptions().scaling(yarn));
    ADD_FAILURE() << "lists accepted for yarn";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("rope scaling type 'yarn' reads no list key (short_factor, long_factor)"),
              std::string::npos) << e.what();
  }
}

TEST(ApplyRope, RotaryOffsetRotatesTheFeaturesItNames) {
  // DeepSeek's [nope | rope] heads: the last 4 of 12 features rotate, the rest pass through.
  auto q = torch::randn({2, 5, 3, 12});
  auto k = torch::randn({2, 5, 1, 12});
  auto [oq, ok] = posenc::apply_rope(q, k, posenc::ApplyRopeOptions().rotary_offset(8).offset(3));
  auto [wq, wk] = posenc::apply_rope(q.slice(-1, 8).contiguous(), k.slice(-1, 8).contiguous(),
                                     posenc::ApplyRopeOptions().offset(3));
  EXPECT_TRUE(torch::equal(oq.slice(-1, 0, 8), q.slice(-1, 0, 8)));
  EXPECT_TRUE(torch::equal(oq.slice(-1, 8), wq));
  EXPECT_TRUE(torch::equal(ok.slice(-1, 8), wk));
  posenc::RotaryPositionalEncoding m(
      posenc::RotaryPositionalEncodingOptions(12).rotary_offset(8).max_len(64));
  auto [mq, mk] = m->forward(q, k, std::nullopt, 3);
  EXPECT_TRUE(torch::equal(mq, oq));
  EXPECT_TRUE(torch::equal(mk, ok));
  EXPECT_THROW(posenc::apply_rope(q, posenc::ApplyRopeOptions().rotary_offset(12)), c10::ValueError);
  EXPECT_THROW(posenc::apply_rope(q, posenc::ApplyRopeOptions().rotary_offset(8).rotary_dim(6)),
               c10::ValueError);
}

// The C++ front end's options against the formula, in float64 (not against other posenc
// calls, which would share a front end that dropped or misread an option): base,
// interleaved pairs, rotary_dim, rotary_offset, offset, per-row offsets, (B, S) positions,
// inverse, and the "bhsd" layout.
torch::Tensor reference_rope(const torch::Tensor& x, const torch::Tensor& pos, double base, bool interleaved,
                             int64_t rot_offset, int64_t rot_dim, bool inverse) {
  // x (B, S, H, D) float64; pos (B, S): features [rot_offset, rot_offset + rot_dim) turn.
  auto inv = 1.0 / torch::pow(torch::tensor(base, torch::kDouble),
                              torch::arange(0, rot_dim, 2, torch::kDouble) / static_cast<double>(rot_dim));
  auto angle = (pos.to(torch::kDouble).unsqueeze(-1) * inv).unsqueeze(2) * (inverse ? -1.0 : 1.0);
  const auto c = angle.cos(), s = angle.sin();
  auto part = x.slice(-1, rot_offset, rot_offset + rot_dim);
  torch::Tensor turned;
  if (interleaved) {
    auto x1 = part.slice(-1, 0, rot_dim, 2), x2 = part.slice(-1, 1, rot_dim, 2);
    turned = torch::stack({x1 * c - x2 * s, x2 * c + x1 * s}, -1).flatten(-2);
  } else {
    auto x1 = part.slice(-1, 0, rot_dim / 2), x2 = part.slice(-1, rot_dim / 2);
    turned = torch::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
  }
  auto out = x.clone();
  out.slice(-1, rot_offset, rot_offset + rot_dim).copy_(turned);
  return out;
}

TEST(ApplyRope, OptionsAgainstTheFormula) {
  torch::manual_seed(5);
  const int64_t B = 2, S = 5, D = 16;
  auto q = torch::randn({B, S, 3, D}, torch::kDouble);
  auto k = torch::randn({B, S, 1, D}, torch::kDouble);
  auto positions = torch::randint(0, 300, {B, S}, torch::kLong);
  auto offsets = torch::tensor({7, 40}, torch::kLong);
  int cases = 0;
  for (double base : {500.0, 1e6}) {
    for (bool interleaved : {false, true}) {
      for (auto [rot_offset, rot_dim] : {std::pair<int64_t, int64_t>{0, 16}, {0, 6}, {4, 12}, {10, 6}}) {
        for (int where = 0; where < 3; ++where) {  // offset; per-row offsets; (B, S) positions
          for (bool inverse : {false, true}) {
            auto o = posenc::ApplyRopeOptions().base(base).interleaved(interleaved).rotary_offset(rot_offset)
                         .inverse(inverse);
            if (rot_offset + rot_dim != D || rot_offset == 0) o.rotary_dim(rot_dim);
            torch::Tensor pos;
            if (where == 0) {
              o.offset(3);
              pos = (torch::arange(S, torch::kLong) + 3).expand({B, S});
            } else if (where == 1) {
              o.offsets(offsets);
              pos = torch::arange(S, torch::kLong).unsqueeze(0) + offsets.unsqueeze(1);
            } else {
              o.positions(positions);
              pos = positions;
            }
            auto [oq, ok] = posenc::apply_rope(q, k, o);
            auto wq = reference_rope(q, pos, base, interleaved, rot_offset, rot_dim, inverse);
            auto wk = reference_rope(k, pos, base, interleaved, rot_offset, rot_dim, inverse);
            EXPECT_TRUE(torch::allclose(oq, wq, 1e-12, 1e-12)) << base << interleaved << rot_offset << rot_dim << where;
            EXPECT_TRUE(torch::allclose(ok, wk, 1e-12, 1e-12)) << base << interleaved << rot_offset << rot_dim << where;
            // The same call on "bhsd" tensors.
            auto bq = posenc::apply_rope(q.transpose(1, 2).contiguous(), o.layout("bhsd"));
            EXPECT_TRUE(torch::allclose(bq.transpose(1, 2), wq, 1e-12, 1e-12));
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 96);
}

}  // namespace

// ---- One description of a RoPE call, and multi-axis RoPE.

#include <ATen/core/dispatch/Dispatcher.h>

#include "ops/common/rope_call.h"

namespace {

TEST(RopeCall, ArgumentListMatchesEverySchema) {
  for (const char* name : {"posenc::rope", "posenc::rope_", "posenc::rope_position_bounds",
                           "posenc::rope_position_extremes"}) {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
    EXPECT_NO_THROW(posenc::ops::check_rope_schema_matches(op.schema())) << name;
  }
}

// The defaults are stated in the schema (kRopeSchemaArguments), in RopeCall's fields and in
// ApplyRopeOptions (POSENC_ROPE_CONFIG_OPTIONS): a call built from each, pushed for a boxed
// call, is the schema's defaults (a direct dispatcher call and the C++ API then agree).
TEST(RopeCall, TheDefaultsOfTheCallAndOfTheOptionsAreTheSchemas) {
  const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow("posenc::rope", "").schema();
  const auto q = torch::zeros({1, 1, 1, 8});
  for (const bool from_options : {false, true}) {
    posenc::ops::RopeCall call;
    if (from_options) call = posenc::detail::make_rope_call(q, std::nullopt, posenc::ApplyRopeOptions(), 0);
    torch::jit::Stack stack;
    call.push(stack);
    ASSERT_EQ(stack.size(), schema.arguments().size());
    int compared = 0;
    for (size_t i = 0; i < stack.size(); ++i) {
      const auto& a = schema.arguments()[i];
      if (!a.default_value().has_value()) continue;  // q
      const c10::IValue& want = *a.default_value();
      const c10::IValue& got = stack[i];
      if (want.isNone()) {
        EXPECT_TRUE(got.isNone() || (got.isTensor() && !got.toTensor().defined())) << a.name();
      } else {
        EXPECT_EQ(got, want) << a.name() << ": " << got << " against the schema's " << want
                             << (from_options ? " (from ApplyRopeOptions)" : " (RopeCall)");
      }
      ++compared;
    }
    EXPECT_GE(compared, 14);
  }
}

TEST(RopeMultiAxis, TextTokensAreExactlyOneAxisRope) {
  torch::manual_seed(0);
  auto q = torch::randn({2, 6, 3, 16});
  auto k = torch::randn({2, 6, 1, 16});
  auto pos = torch::randint(0, 1000, {2, 6}, torch::kLong);
  auto [oq, ok] = posenc::apply_rope(q, k, posenc::ApplyRopeOptions().positions(pos));
  for (const char* mode : {"mrope", "mrope_interleaved"}) {
    auto [mq, mk] = posenc::apply_rope(
        q, k,
        posenc::ApplyRopeOptions().positions(pos.expand({3, 2, 6})).sections({4, 2, 2}).sections_mode(mode));
    EXPECT_TRUE(torch::equal(mq, oq)) << mode;
    EXPECT_TRUE(torch::equal(mk, ok)) << mode;
  }
}

// Axial 2-D RoPE written from the formula: pairs [0, s0) turn with the row at
// base^(-j/s0), pairs [s0, s0 + s1) with the column at base^(-j/s1); halves convention.
TEST(RopeMultiAxis, AxialMatchesTheFormula) {
  torch::manual_seed(1);
  const int64_t s0 = 3, s1 = 5, half = s0 + s1, D = 2 * half + 4;  // 4 features pass through
  auto x = torch::randn({1, 7, 2, D}, torch::kDouble);
  auto pos = posenc::rope_grid_positions({1, 7});  // (2, 7): rows 0, cols 0..6
  pos[0] = torch::arange(7, torch::kLong) * 3 + 1;
  auto out = posenc::apply_rope(x, posenc::ApplyRopeOptions().positions(pos).sections({s0, s1}));
  auto want = x.clone();
  for (int64_t p = 0; p < half; ++p) {
    const bool row = p < s0;
    const int64_t j = row ? p : p - s0;
    const double inv = std::pow(10000.0, -static_cast<double>(j) / (row ? s0 : s1));
    auto angle = pos[row ? 0 : 1].to(torch::kDouble) * inv;  // (7,)
    auto c = angle.cos().view({1, 7, 1}), s = angle.sin().view({1, 7, 1});
    auto x1 = x.select(3, p), x2 = x.select(3, p + half);
    want.select(3, p).copy_(x1 * c - x2 * s);
    want.select(3, p + half).copy_(x2 * c + x1 * s);
  }
  EXPECT_TRUE(torch::allclose(out, want, 1e-12, 1e-12));
}

TEST(RopeMultiAxis, GridPositionsAndModule) {
  auto grid = posenc::rope_grid_positions({2, 3}, 1);
  auto want = torch::tensor({0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 2, 0, 1, 2}, torch::kLong).view({2, 7});
  EXPECT_TRUE(torch::equal(grid, want));
  posenc::RotaryPositionalEncoding rope(
      posenc::RotaryPositionalEncodingOptions(16).max_len(8).sections({2, 3, 3}).sections_mode("mrope"));
  auto q = torch::randn({1, 7, 2, 16});
  auto pos = torch::randint(0, 8, {3, 7}, torch::kLong);
  auto [oq, ok] = rope->forward(q, q, pos);
  auto want_q = posenc::apply_rope(
      q, posenc::ApplyRopeOptions().positions(pos).sections({2, 3, 3}).sections_mode("mrope"));
  EXPECT_TRUE(torch::equal(oq, want_q));
  pos[2][4] = 8;  // the last axis is range-checked too
  EXPECT_THROW(rope->forward(q, q, pos), c10::IndexError);
  EXPECT_THROW(posenc::apply_rope(q, posenc::ApplyRopeOptions().positions(pos).sections({2, 3, 2}).rotary_dim(16)),
               c10::ValueError);
}

}  // namespace

// ---- longrope (Phi-3) and rotation with given cos/sin tables.

namespace {

TEST(RopeLongrope, ModuleFillsFactorAndSwitchesToLongFactors) {
  posenc::RopeScaling s;
  s.rope_type = "longrope";
  s.original_max_position_embeddings = 16;
  s.short_factor = {1.0, 1.5, 2.0, 3.0};
  s.long_factor = {2.0, 4.0, 8.0, 16.0};
  // The module's max_len plays transformers' max_position_embeddings: factor 64 / 16.
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8).max_len(64).scaling(s));
  const double attention = std::sqrt(1.0 + std::log(4.0) / std::log(16.0));
  auto q = torch::randn({1, 20, 2, 8}, torch::kDouble);
  auto [out, unused] = rope->forward_at(q, q, posenc::RopePositions());  // longest 19 > 16: long
  auto inv = 1.0 / (torch::tensor(s.long_factor, torch::kDouble) *
                    torch::pow(torch::tensor(10000.0, torch::kDouble), torch::arange(0, 8, 2, torch::kDouble) / 8.0));
  auto angle = torch::arange(20, torch::kDouble).unsqueeze(-1) * inv;
  auto emb = torch::cat({angle, angle}, -1).unsqueeze(1).unsqueeze(0);
  auto rotated = torch::cat({-q.slice(-1, 4), q.slice(-1, 0, 4)}, -1);
  auto want = (q * emb.cos() + rotated * emb.sin()) * attention;
  EXPECT_TRUE(torch::allclose(out, want, 1e-12, 1e-12));
  posenc::RopeScaling bad = s;
  bad.long_factor = {1.0};
  EXPECT_THROW(bad.values(), c10::ValueError);
  // max_position_embeddings apart from max_len (the range check): the factor, and so the
  // attention factor, come from the model's length, not from a narrower max_len.
  posenc::RotaryPositionalEncoding narrow(
      posenc::RotaryPositionalEncodingOptions(8).max_len(32).max_position_embeddings(64).scaling(s));
  EXPECT_DOUBLE_EQ(narrow->attention_scaling(), rope->attention_scaling());
  EXPECT_TRUE(torch::equal(std::get<0>(narrow->forward_at(q, q, posenc::RopePositions())), out));
  posenc::RotaryPositionalEncoding by_max_len(posenc::RotaryPositionalEncodingOptions(8).max_len(32).scaling(s));
  EXPECT_NE(by_max_len->attention_scaling(), rope->attention_scaling());
  EXPECT_THROW(posenc::RotaryPositionalEncoding(
                   posenc::RotaryPositionalEncodingOptions(8).max_len(32).max_position_embeddings(0).scaling(s)),
               c10::ValueError);
  // "dynamic" takes the model's length given apart from max_len as its baseline (it refused a
  // dict without the key although the model's length was given).
  posenc::RopeScaling dynamic;
  dynamic.rope_type = "dynamic";
  dynamic.factor = 2.0;
  posenc::RopeScaling keyed = dynamic;
  keyed.original_max_position_embeddings = 16;
  auto long_q = torch::randn({1, 40, 2, 8}, torch::kDouble);
  posenc::RotaryPositionalEncoding by_model(
      posenc::RotaryPositionalEncodingOptions(8).max_len(64).max_position_embeddings(16).scaling(dynamic));
  posenc::RotaryPositionalEncoding by_key(posenc::RotaryPositionalEncodingOptions(8).max_len(64).scaling(keyed));
  EXPECT_TRUE(torch::equal(std::get<0>(by_model->forward_at(long_q, long_q, posenc::RopePositions())),
                           std::get<0>(by_key->forward_at(long_q, long_q, posenc::RopePositions()))));
  EXPECT_THROW(posenc::RotaryPositionalEncoding(
                   posenc::RotaryPositionalEncodingOptions(8).max_len(64).scaling(dynamic)),
               c10::ValueError);
  // The scaling applied (positions past 16 rotate otherwise than unscaled).
  posenc::RotaryPositionalEncoding plain(posenc::RotaryPositionalEncodingOptions(8).max_len(64));
  EXPECT_FALSE(torch::allclose(std::get<0>(by_model->forward_at(long_q, long_q, posenc::RopePositions())),
                               std::get<0>(plain->forward_at(long_q, long_q, posenc::RopePositions()))));
  // Both lengths given and different: two readings (transformers reads the model's, posenc
  // the key), refused as rope_cos_sin refuses them; equal ones agree.
  EXPECT_THROW(posenc::RotaryPositionalEncoding(
                   posenc::RotaryPositionalEncodingOptions(8).max_len(64).max_position_embeddings(32).scaling(keyed)),
               c10::ValueError);
  posenc::RotaryPositionalEncoding both(
      posenc::RotaryPositionalEncodingOptions(8).max_len(64).max_position_embeddings(16).scaling(keyed));
  EXPECT_TRUE(torch::equal(std::get<0>(both->forward_at(long_q, long_q, posenc::RopePositions())),
                           std::get<0>(by_key->forward_at(long_q, long_q, posenc::RopePositions()))));
}

TEST(ApplyRopeCosSin, MatchesApplyRopeAndBackwardIsTheTranspose) {
  auto q = torch::randn({2, 3, 5, 8}, torch::requires_grad(true).dtype(torch::kDouble));  // bhsd
  auto k = torch::randn({2, 1, 5, 8}, torch::requires_grad(true).dtype(torch::kDouble));
  auto inv = 1.0 / torch::pow(torch::tensor(10000.0, torch::kDouble), torch::arange(0, 8, 2, torch::kDouble) / 8.0);
  auto angle = torch::arange(5, torch::kDouble).unsqueeze(-1) * inv;
  auto emb = torch::cat({angle, angle}, -1);
  auto [oq, ok] = posenc::apply_rope_cos_sin(q, k, emb.cos(), emb.sin());
  auto [wq, wk] = posenc::apply_rope(q, k, posenc::ApplyRopeOptions().layout("bhsd"));
  EXPECT_TRUE(torch::allclose(oq, wq, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(ok, wk, 1e-12, 1e-12));
  auto gq = torch::randn_like(oq), gk = torch::randn_like(ok);
  ((oq * gq).sum() + (ok * gk).sum()).backward();
  auto [bq, bk] = posenc::apply_rope(q.grad(), k.grad(), posenc::ApplyRopeOptions().layout("bhsd"));
  EXPECT_TRUE(torch::allclose(bq, gq, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(bk, gk, 1e-12, 1e-12));
  EXPECT_THROW(posenc::apply_rope_cos_sin(q, k, emb.cos(), emb.sin(), "sbhd"), c10::ValueError);
}

}  // namespace

// ---- The facts of each scaling type (POSENC_ROPE_TYPES) against the C++ front ends.

namespace {

// A valid configuration of every type for rotary_dim 8 (a new type needs one here).
posenc::RopeScaling sample_scaling(const std::string& type) {
  posenc::RopeScaling s;
  s.rope_type = type;
  if (type == "default") return s;
  s.factor = 4.0;
  // (only where the type reads it: a key it does not read is refused)
  if (posenc::math::rope_type_keys(posenc::ops::parse_rope_type(type)) &
      posenc::math::rope_key_bit(posenc::math::RopeKey::original_max_position_embeddings)) {
    s.original_max_position_embeddings = 16;
  }
  if (type == "llama3") {
    s.low_freq_factor = 1.0;
    s.high_freq_factor = 4.0;
  } else if (type == "longrope") {
    s.short_factor = {1.0, 1.25, 1.5, 2.0};
    s.long_factor = {2.0, 3.0, 5.0, 9.0};
  } else if (type == "proportional") {
    s.partial_rotary_factor = 0.5;
  }
  return s;
}

// The rope op called directly with an explicit seq_len.
torch::Tensor rope_op(const torch::Tensor& q, const torch::Tensor& positions,
                      const posenc::RopeScaling& s, int64_t seq_len) {
  posenc::ops::RopeCall c;
  c.q = q;
  c.positions = positions;
  c.scaling = posenc::ops::parse_rope_scaling(s.rope_type, s.values());
  c.seq_len = seq_len;
  return std::get<0>(posenc::ops::call_rope(c));
}

TEST(RopeTypeFacts, FunctionAndModulePassTheLengthOfLengthScaledTypes) {
  auto q = torch::randn({2, 5, 2, 8}, torch::kDouble);
  auto positions = torch::tensor({0, 3, 9, 2, 40, 1, 1, 7, 33, 6}, torch::kLong).reshape({2, 5});
  for (const std::string& type : posenc::ops::rope_type_names()) {
    const posenc::RopeScaling s = sample_scaling(type);
    const bool by_length =
        posenc::math::rope_type_facts(posenc::ops::parse_rope_type(type)) & posenc::math::kRopeScalesByLength;
    auto want = rope_op(q, positions, s, 41);  // the longest position + 1
    // The check can fail: a front end passing seq_len 0 gets other numbers for these types.
    EXPECT_EQ(torch::equal(rope_op(q, positions, s, 0), want), !by_length) << type;
    auto function = posenc::apply_rope(q, posenc::ApplyRopeOptions().positions(positions).scaling(s));
    EXPECT_TRUE(torch::equal(function, want)) << type;
    posenc::RotaryPositionalEncoding module(posenc::RotaryPositionalEncodingOptions(8).max_len(64).scaling(s));
    EXPECT_TRUE(torch::equal(std::get<0>(module(q, q, positions)), want)) << type;
  }
}

// A call's output, or nullopt when it is refused; and the two compared.
template <typename F>
std::variant<torch::Tensor, std::string> attempt(F&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return std::string(e.what_without_backtrace());
  }
}

bool succeeded(const std::variant<torch::Tensor, std::string>& r) {
  return std::holds_alternative<torch::Tensor>(r);
}

// The same tensor, or the same refusal (its message: two refusals for different reasons
// are not agreement).
bool same(const std::variant<torch::Tensor, std::string>& a, const std::variant<torch::Tensor, std::string>& b) {
  if (succeeded(a) != succeeded(b)) return false;
  if (succeeded(a)) return torch::equal(std::get<torch::Tensor>(a), std::get<torch::Tensor>(b));
  return std::get<std::string>(a) == std::get<std::string>(b);
}

TEST(RopeTypeFacts, ModuleFillsTheModelDefaultsOfTheFacts) {
  auto q = torch::randn({1, 6, 1, 8}, torch::kDouble);
  auto positions = torch::tensor({0, 5, 17, 30, 2, 63}, torch::kLong).reshape({1, 6});
  const int64_t max_len = 64;
  const auto module_output = [&](const posenc::RopeScaling& s) {
    return attempt([&] {
      posenc::RotaryPositionalEncoding m(posenc::RotaryPositionalEncodingOptions(8).max_len(max_len).scaling(s));
      return std::get<0>(m(q, q, positions));
    });
  };
  // What the dict alone gives (no model defaults): the op with the module's seq_len.
  const auto op_output = [&](const posenc::RopeScaling& s) {
    return attempt([&] { return rope_op(q, positions, s, max_len); });
  };
  for (const std::string& type : posenc::ops::rope_type_names()) {
    if (type == "default") continue;  // no keys
    const unsigned facts = posenc::math::rope_type_facts(posenc::ops::parse_rope_type(type));
    // original_max_position_embeddings: max_len for the types that take the model's, refused
    // where that default would make length scaling a no-op, else left to the op.
    posenc::RopeScaling no_orig = sample_scaling(type);
    no_orig.original_max_position_embeddings.reset();
    posenc::RopeScaling filled = no_orig;
    filled.original_max_position_embeddings = static_cast<double>(max_len);
    if ((facts & posenc::math::kRopeOriginalFromModel) && (facts & posenc::math::kRopeScalesByLength)) {
      EXPECT_THROW(
          posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(8).max_len(max_len).scaling(no_orig)),
          c10::ValueError)
          << type;
    } else if (facts & posenc::math::kRopeOriginalFromModel) {
      EXPECT_TRUE(succeeded(module_output(no_orig))) << type;
      EXPECT_TRUE(same(module_output(no_orig), op_output(filled))) << type;
    } else {
      EXPECT_TRUE(same(module_output(no_orig), op_output(no_orig))) << type;
    }
    // factor: max_len / original_max_position_embeddings for the types that take it.
    posenc::RopeScaling no_factor = sample_scaling(type);
    no_factor.factor.reset();
    no_factor.attention_factor.reset();
    posenc::RopeScaling with_factor = no_factor;
    if (facts & posenc::math::kRopeFactorFromModel) {
      with_factor.factor = static_cast<double>(max_len) / *no_factor.original_max_position_embeddings;
      EXPECT_TRUE(succeeded(module_output(no_factor))) << type;
    }
    const auto got = module_output(no_factor), want = op_output(with_factor);
    EXPECT_TRUE(same(got, want)) << type << ": " << (succeeded(got) ? "" : std::get<std::string>(got)) << " / "
                                 << (succeeded(want) ? "" : std::get<std::string>(want));
  }
}

}  // namespace

// Presence is the std::optional's (issue 34): a value set to the lowest double (the former
// in-band "not given" marker) or NaN is checked as a value, never read as absent.
TEST(RopeScalingPresence, EveryValueSetIsCheckedAsAValue) {
  for (double bad : {-std::numeric_limits<double>::max(), -1e308, std::nan("")}) {
    posenc::RopeScaling s;
    s.rope_type = "linear";
    s.factor = bad;
    EXPECT_THROW(posenc::rope_frequencies(8, 10000.0, s), c10::ValueError) << bad;
  }
  posenc::RopeScaling yarn;
  yarn.rope_type = "yarn";
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 64.0;
  const auto [inv, factor] = posenc::rope_frequencies(8, 10000.0, yarn);
  yarn.beta_fast = 32.0;  // the default, now given: the same frequencies
  const auto [inv_given, factor_given] = posenc::rope_frequencies(8, 10000.0, yarn);
  EXPECT_TRUE(torch::equal(inv, inv_given));
  EXPECT_EQ(factor, factor_given);
  yarn.beta_fast = -std::numeric_limits<double>::max();
  EXPECT_THROW(posenc::rope_frequencies(8, 10000.0, yarn), c10::ValueError);
}

// ApplyRopeOptions().inverse(true): the rotation by minus the angle, undoing the rotation
// (DeepSeek V4's attention output), with the forward rotation as its gradient.
TEST(Rope, InverseUndoesTheRotationAndItsGradientIsTheRotation) {
  torch::manual_seed(11);
  const auto x = torch::randn({2, 5, 3, 16}, torch::kDouble).requires_grad_(true);
  const auto opts = posenc::ApplyRopeOptions().offset(7).interleaved(true);
  auto inv = opts;
  inv.inverse(true);
  const auto y = posenc::apply_rope(x, inv);
  EXPECT_TRUE(torch::allclose(posenc::apply_rope(y, opts), x, 1e-12, 1e-12));
  const auto g = torch::randn_like(x);
  y.backward(g);
  EXPECT_TRUE(torch::allclose(x.grad(), posenc::apply_rope(g, opts), 1e-12, 1e-12));
}

TEST(RopeInPlace, MovesVersionsUnderInferenceModeAndRefusesInferenceTensorsOutsideIt) {
  // The ADInplaceOrView layer moves the versions of what the op writes (autograd does not
  // run under InferenceMode), so a graph that saved q refuses to differentiate it later.
  auto q = torch::randn({1, 4, 2, 8});
  const auto before = q._version();
  {
    c10::InferenceMode guard;
    posenc::apply_rope_(q, std::nullopt);
  }
  EXPECT_EQ(q._version(), before + 1);
  torch::Tensor made_in_inference;
  {
    c10::InferenceMode guard;
    made_in_inference = torch::randn({1, 4, 2, 8});
  }
  const auto kept = made_in_inference.clone();
  EXPECT_THROW(posenc::apply_rope_(made_in_inference, std::nullopt), c10::Error);
  EXPECT_TRUE(torch::equal(made_in_inference, kept));  // refused before any write
}

// reset() after changing the options gives what a module built with them gives: the model's
// defaults it derives from max_len (yarn's original_max_position_embeddings, longrope's
// factor) are derived again, not read back as given (they were written into options).
TEST(RotaryModule, ResetAfterChangingMaxLenIsAFreshModule) {
  auto q = torch::randn({1, 8, 2, 16}, torch::kDouble);
  auto positions = torch::arange(8000, 8008, torch::kLong);
  posenc::RopeScaling yarn;
  yarn.rope_type = "yarn";
  yarn.factor = 4.0;
  posenc::RopeScaling longrope;
  longrope.rope_type = "longrope";
  longrope.original_max_position_embeddings = 1024.0;
  longrope.short_factor = std::vector<double>(8, 1.0);
  longrope.long_factor = std::vector<double>(8, 2.0);
  for (const auto& s : {yarn, longrope}) {
    posenc::RotaryPositionalEncoding m(posenc::RotaryPositionalEncodingOptions(16).max_len(4096).scaling(s));
    m->options.max_len(16384);
    m->reset();
    posenc::RotaryPositionalEncoding fresh(posenc::RotaryPositionalEncodingOptions(16).max_len(16384).scaling(s));
    EXPECT_TRUE(torch::equal(m->inv_freq(), fresh->inv_freq())) << s.rope_type;
    EXPECT_EQ(m->attention_scaling(), fresh->attention_scaling()) << s.rope_type;
    EXPECT_TRUE(torch::equal(std::get<0>(m(q, q, positions)), std::get<0>(fresh(q, q, positions)))) << s.rope_type;
    EXPECT_FALSE(m->options.scaling().original_max_position_embeddings.has_value() && s.rope_type == "yarn");
  }
}

TEST(RotaryModule, ALongropeBaselineOfZeroIsNamedNotItsDerivedFactor) {
  // longrope's factor is max_position_embeddings / original_max_position_embeddings: a
  // baseline of 0 gave factor inf, and the error blamed 'factor', a key never passed (as in
  // Python, the op now names the baseline).
  posenc::RopeScaling s;
  s.rope_type = "longrope";
  s.original_max_position_embeddings = 0.0;
  s.short_factor = std::vector<double>(4, 1.0);
  s.long_factor = std::vector<double>(4, 2.0);
  try {
    posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(8).max_len(64).scaling(s));
    ADD_FAILURE() << "a longrope baseline of 0 was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'original_max_position_embeddings' to be a positive number, got 0"),
              std::string::npos) << e.what();
  }
}

TEST(RotaryModule, InvFreqIsWhatForwardRotatesWithUntilReset) {
  // Options edited without reset(): forward still rotates with the parsed ones, and so do
  // inv_freq() and attention_scaling() (they read the edited base and sections before).
  auto q = torch::randn({1, 8, 2, 16}, torch::kDouble);
  posenc::RotaryPositionalEncoding m(posenc::RotaryPositionalEncodingOptions(16).max_len(64));
  const torch::Tensor inv = m->inv_freq();
  const torch::Tensor out = std::get<0>(m(q, q));
  m->options.base(500.0);
  EXPECT_TRUE(torch::equal(m->inv_freq(), inv));
  EXPECT_TRUE(torch::equal(std::get<0>(m(q, q)), out));
  m->reset();
  posenc::RotaryPositionalEncoding fresh(posenc::RotaryPositionalEncodingOptions(16).max_len(64).base(500.0));
  EXPECT_TRUE(torch::equal(m->inv_freq(), fresh->inv_freq()));
  EXPECT_FALSE(torch::equal(m->inv_freq(), inv));
  EXPECT_TRUE(torch::equal(std::get<0>(m(q, q)), std::get<0>(fresh(q, q))));
}

TEST(RotaryModule, MaxLenAndDimAreTheParsedOnesUntilReset) {
  // forward read max_len, dim and sections from the live options and the rest (the yarn
  // baseline reset() derived from max_len) from the parsed ones: after options.max_len(8192)
  // without reset(), positions up to 8191 were rotated with the baseline of 4096, numbers no
  // module of either max_len computes. Now all of them are the parsed ones until reset().
  auto q = torch::randn({1, 4, 2, 16}, torch::kDouble);
  posenc::RopeScaling yarn;
  yarn.rope_type = "yarn";
  yarn.factor = 4.0;
  posenc::RotaryPositionalEncoding m(posenc::RotaryPositionalEncodingOptions(16).max_len(4096).scaling(yarn));
  m->options.max_len(8192).dim(8);
  const auto beyond = torch::arange(5000, 5004, torch::kLong);
  EXPECT_THROW(m(q, q, beyond), c10::IndexError);
  const auto inside = torch::arange(100, 104, torch::kLong);
  posenc::RotaryPositionalEncoding same(posenc::RotaryPositionalEncodingOptions(16).max_len(4096).scaling(yarn));
  EXPECT_TRUE(torch::equal(std::get<0>(m(q, q, inside)), std::get<0>(same(q, q, inside))));
  m->options.dim(16);
  m->reset();
  posenc::RotaryPositionalEncoding fresh(posenc::RotaryPositionalEncodingOptions(16).max_len(8192).scaling(yarn));
  EXPECT_TRUE(torch::equal(std::get<0>(m(q, q, beyond)), std::get<0>(fresh(q, q, beyond))));
}

// What the module prints is what forward uses: the parsed settings (it printed options
// edited since reset(), beside the parsed rotary_dim).
TEST(RotaryModule, PrintsTheSettingsForwardUses) {
  posenc::RotaryPositionalEncoding m(posenc::RotaryPositionalEncodingOptions(8).max_len(16));
  m->options.max_len(4).base(500.0).dim(4);
  std::ostringstream printed;
  m->pretty_print(printed);
  EXPECT_EQ(printed.str(), "posenc::RotaryPositionalEncoding(dim=8, max_len=16, base=10000, interleaved=false, "
                           "rotary_dim=8, scaling=default, layout=bshd)");
  m->options.dim(8);
  m->reset();
  std::ostringstream after;
  m->pretty_print(after);
  EXPECT_NE(after.str().find("max_len=4, base=500,"), std::string::npos) << after.str();
}

// The modules work inside torch::nn::AnyModule / Sequential, which call forward with the
// required arguments only (FORWARD_HAS_DEFAULT_ARGS).
TEST(RotaryModule, ModulesWorkInAnyModuleAndSequential) {
  auto x = torch::randn({2, 5, 8});
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(8).max_len(16));
  pe->eval();
  torch::nn::Sequential seq(pe);
  EXPECT_TRUE(torch::equal(seq->forward(x), pe(x)));
  posenc::LearnedPositionalEncoding learned(posenc::LearnedPositionalEncodingOptions(8).max_len(16));
  learned->eval();
  EXPECT_TRUE(torch::equal(torch::nn::AnyModule(learned).forward(x), learned(x)));
  auto q = torch::randn({1, 5, 2, 8});
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8).max_len(16));
  auto [aq, ak] = torch::nn::AnyModule(rope).forward<std::tuple<torch::Tensor, torch::Tensor>>(q, q);
  EXPECT_TRUE(torch::equal(aq, std::get<0>(rope(q, q))));
  posenc::QKNormRotary qkn(posenc::QKNormRotaryOptions(8));
  auto [nq, nk] = torch::nn::AnyModule(qkn).forward<std::tuple<torch::Tensor, torch::Tensor>>(q, q);
  EXPECT_TRUE(torch::equal(nq, std::get<0>(qkn(q, q))));
}

// Meta tensors (shapes only) go through the module as through the function: nothing to
// range-check (it read the meta positions back: "Cannot copy out of meta tensor").
TEST(RotaryModule, MetaTensorsGiveMetaOutputs) {
  auto q = torch::empty({1, 8, 4, 64}, torch::TensorOptions().device(torch::kMeta));
  auto positions = torch::empty({8}, torch::TensorOptions().dtype(torch::kLong).device(torch::kMeta));
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(64).max_len(16));
  auto [oq, ok] = rope(q, q, positions);
  EXPECT_TRUE(oq.is_meta());
  EXPECT_EQ(oq.sizes(), q.sizes());
}

// seq_len, as Python's seq_len=: the length "dynamic" / "longrope" scale for, given (a shard
// of a longer sequence) instead of read from the call; ignored by the other types; < 0 is a
// ValueError. The same in the function, the module (RopePositions) and QK-norm.
TEST(RopeTypeFacts, SeqLenIsTheLengthALengthScaledTypeScalesFor) {
  auto q = torch::randn({1, 4, 2, 8}, torch::kDouble);
  posenc::RopeScaling dynamic;
  dynamic.rope_type = "dynamic";
  dynamic.factor = 2.0;
  dynamic.original_max_position_embeddings = 8.0;
  const auto at = [&](std::optional<int64_t> seq_len) {
    return std::get<0>(posenc::apply_rope(q, q, posenc::ApplyRopeOptions().scaling(dynamic).offset(2).seq_len(seq_len)));
  };
  EXPECT_TRUE(torch::equal(at(std::nullopt), at(6)));  // the longest position + 1 of the call
  EXPECT_FALSE(torch::allclose(at(6), at(64)));        // a longer global sequence scales further
  EXPECT_THROW(at(-1), c10::ValueError);
  posenc::RotaryPositionalEncoding plain_module(posenc::RotaryPositionalEncodingOptions(8).max_len(100));
  EXPECT_THROW(plain_module->forward_at(q, q, posenc::RopePositions().seq_len(-1)), c10::ValueError);
  auto plain = posenc::ApplyRopeOptions().offset(2);
  EXPECT_TRUE(torch::equal(std::get<0>(posenc::apply_rope(q, q, plain)),
                           std::get<0>(posenc::apply_rope(q, q, plain.seq_len(64)))));
  posenc::RotaryPositionalEncoding m(posenc::RotaryPositionalEncodingOptions(8).max_len(100).scaling(dynamic));
  EXPECT_TRUE(torch::equal(std::get<0>(m->forward_at(q, q, posenc::RopePositions().offset(2).seq_len(64))), at(64)));
  posenc::QKNormRotary n(posenc::QKNormRotaryOptions(8).rope(posenc::ApplyRopeOptions().scaling(dynamic)));
  n->to(torch::kDouble);
  const auto want_n = posenc::qk_norm_rope(q, q, n->q_norm->weight, n->k_norm->weight,
                                           posenc::QkNormRopeOptions().rope(
                                               posenc::ApplyRopeOptions().scaling(dynamic).offset(2).seq_len(64)));
  EXPECT_TRUE(torch::equal(std::get<0>(n(q, q, posenc::RopePositions().offset(2).seq_len(64))), std::get<0>(want_n)));
}

// q alone, as Python's rope(x): an undefined k (it was a ValueError naming a shape [0]).
TEST(RotaryModule, RotatesQAloneWhenKIsUndefined) {
  auto q = torch::randn({2, 5, 3, 8}, torch::kDouble);
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8).max_len(16));
  auto [alone, none] = rope(q, torch::Tensor(), std::nullopt, 4);
  EXPECT_FALSE(none.defined());
  EXPECT_TRUE(torch::equal(alone, posenc::apply_rope(q, posenc::ApplyRopeOptions().offset(4))));
  // apply_rope_cos_sin too (its op's empty second output was handed on, defined).
  auto cos = torch::randn({5, 8}, torch::kDouble), sin = torch::randn({5, 8}, torch::kDouble);
  auto [rotated, no_k] = posenc::apply_rope_cos_sin(q, torch::Tensor(), cos, sin, "bshd");
  EXPECT_FALSE(no_k.defined());
  EXPECT_TRUE(torch::equal(rotated, std::get<0>(posenc::apply_rope_cos_sin(q, q, cos, sin, "bshd"))));
}

// In place into a view with the negative bit (z.conj().imag): refused before any write (ATen's
// fallback for the bit wrote a resolved copy back over k, which overlaps q).
TEST(RopeFunctions, InPlaceIntoAViewWithTheNegativeBitIsRefused) {
  auto z = torch::randn({1, 5, 1, 4}, torch::kComplexDouble);
  const auto z0 = z.clone();
  auto q = torch::imag(z.conj()).narrow(1, 0, 4);
  auto k = torch::imag(z).narrow(1, 1, 4);
  ASSERT_TRUE(q.is_neg());
  EXPECT_THROW(posenc::apply_rope_(q, k), c10::Error);
  EXPECT_TRUE(torch::equal(torch::view_as_real(z), torch::view_as_real(z0)));
  // Read only, the bit is honoured: the values read are the negated ones.
  auto [got, unused] = posenc::apply_rope(q, q.resolve_neg());
  EXPECT_TRUE(torch::equal(got, posenc::apply_rope(q.resolve_neg())));
}

// A RopeScaling left at its default rope_type with a key set: refused (the key was ignored,
// an unscaled RoPE under a struct that says factor 8), by the function and the module.
TEST(RopeScalingPresence, KeysBesideTheDefaultTypeAreRefused) {
  posenc::RopeScaling s;
  s.factor = 8.0;
  try {
    posenc::apply_rope(torch::randn({1, 3, 2, 8}), torch::Tensor(), posenc::ApplyRopeOptions().scaling(s));
    ADD_FAILURE() << "a factor beside rope_type 'default' was ignored";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("rope scaling type 'default' reads no rope scaling key, got factor"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(8).scaling(s)),
               c10::ValueError);
  s.rope_type = "linear";  // the type that reads it
  EXPECT_NO_THROW(posenc::RotaryPositionalEncoding(posenc::RotaryPositionalEncodingOptions(8).scaling(s)));
  // A key of another type beside it (yarn's mscale): refused as well, naming what linear reads.
  s.mscale = 1.0;
  try {
    posenc::apply_rope(torch::randn({1, 3, 2, 8}), torch::Tensor(), posenc::ApplyRopeOptions().scaling(s));
    ADD_FAILURE() << "mscale beside rope_type 'linear' was ignored";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("rope scaling type 'linear' does not read the rope scaling key(s) mscale "
                                         "(it reads factor)"),
              std::string::npos) << e.what();
  }
}

// Two threads calling one module's forward at once: each gets the single-threaded result.
TEST(RotaryModule, ForwardFromTwoThreadsAtOnce) {
  torch::manual_seed(0);
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(16).max_len(64));
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(16).max_len(64));
  pe->eval();
  const auto q = torch::randn({2, 9, 4, 16}), k = torch::randn({2, 9, 2, 16}), x = torch::randn({2, 9, 16});
  const auto [want_q, want_k] = rope(q, k, std::nullopt, 3);
  const auto want_x = pe(x, 3);
  std::atomic<int> wrong{0};
  auto work = [&] {
    for (int i = 0; i < 200; ++i) {
      auto [oq, ok] = rope(q, k, std::nullopt, 3);
      if (!torch::equal(oq, want_q) || !torch::equal(ok, want_k) || !torch::equal(pe(x, 3), want_x)) ++wrong;
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  EXPECT_EQ(wrong.load(), 0);
}

// torch::load of another module's archive: refused, as Python's strict load_state_dict
// refuses unexpected keys (a LearnedPositionalEncoding's table loaded into a RoPE module
// without a word); a module's own archive loads.
TEST(RotaryModule, LoadRefusesAnotherModulesArchive) {
  const std::string path = ::testing::TempDir() + "posenc_learned_for_rope.pt";
  torch::save(posenc::LearnedPositionalEncoding(posenc::LearnedPositionalEncodingOptions(8).max_len(16)), path);
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(8));
  try {
    torch::load(rope, path);
    ADD_FAILURE() << "another module's archive was loaded";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unexpected tensor or submodule pe in the archive"), std::string::npos)
        << e.what();
  }
  posenc::Timesteps steps(posenc::TimestepsOptions(8, true, 0.0));
  EXPECT_THROW(torch::load(steps, path), c10::Error);
  torch::save(rope, path);
  EXPECT_NO_THROW(torch::load(rope, path));
  torch::save(steps, path);
  EXPECT_NO_THROW(torch::load(steps, path));
  std::remove(path.c_str());
}
