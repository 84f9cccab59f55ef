// GoogleTest: posenc::rope_append_kv (the C++ front end of the KV-cache op) against
// apply_rope followed by index copies into the caches.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "ops/common/cpu/rope_rows.h"  // row_streams, the CPU kernels' streaming rule
#include "ops/rope_append_kv/cpu/kernel.h"  // kv_cache_row, the CPU and CUDA kernels' cache row
#include "posenc/posenc.h"

namespace {

TEST(RopeAppendKv, ContiguousCacheMatchesApplyRopeAndCopies) {
  // Every RoPE option reaches the op as apply_rope's does (apply_rope itself is held to the
  // formula: test_rope.cpp, ApplyRope.OptionsAgainstTheFormula).
  torch::manual_seed(0);
  const int64_t B = 2, S = 3, Hq = 4, Hkv = 2, D = 16, L = 10;
  const auto q = torch::randn({B, S, Hq, D}), k = torch::randn({B, S, Hkv, D}),
             v = torch::randn({B, S, Hkv, D});
  const auto offsets = torch::tensor({1, 6}, torch::kLong);
  posenc::RopeScaling yarn;  // its attention factor scales q and the cached k alike
  yarn.rope_type = "yarn";
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 8;
  const auto base = posenc::ApplyRopeOptions().offsets(offsets).base(500.0);
  int variant = 0;
  for (const auto& rope : {base, posenc::ApplyRopeOptions(base).interleaved(true),
                           posenc::ApplyRopeOptions(base).rotary_dim(6),
                           posenc::ApplyRopeOptions(base).rotary_offset(10).interleaved(true),
                           posenc::ApplyRopeOptions(base).positions(torch::tensor({{4, 2, 9}, {0, 1, 30}})),
                           posenc::ApplyRopeOptions(base).scaling(yarn)}) {
    auto kc = torch::randn({B, L, Hkv, D}), vc = torch::randn({B, L, Hkv, D});
    const auto kc0 = kc.clone(), vc0 = vc.clone();
    auto [out_q, out_k] = posenc::rope_append_kv(q, k, v, kc, vc, posenc::RopeAppendKvOptions().rope(rope).return_k(true));
    // Given positions are where the tokens turn; offsets then only say where they are written
    // (apply_rope adds offsets to positions).
    auto [ref_q, ref_k] = posenc::apply_rope(
        q, k, rope.positions().has_value() ? posenc::ApplyRopeOptions(rope).offsets(std::nullopt) : rope);
    EXPECT_TRUE(torch::equal(out_q, ref_q)) << variant;
    EXPECT_TRUE(torch::equal(out_k, ref_k)) << variant;
    auto want_k = kc0.clone(), want_v = vc0.clone();
    want_k[0].slice(0, 1, 4).copy_(ref_k[0]);
    want_k[1].slice(0, 6, 9).copy_(ref_k[1]);
    want_v[0].slice(0, 1, 4).copy_(v[0]);
    want_v[1].slice(0, 6, 9).copy_(v[1]);
    EXPECT_TRUE(torch::equal(kc, want_k)) << variant;
    EXPECT_TRUE(torch::equal(vc, want_v)) << variant;
    ++variant;
  }
}

// FP8 caches: the float32 call's cache rows divided by the scale, saturated, rounded to
// nearest even (torch's conversion), bit for bit; a scale given as a double or as a tensor.
TEST(RopeAppendKv, Float8CachesHoldTheQuantisedFloat32Rows) {
  torch::manual_seed(3);
  const int64_t B = 2, S = 3, Hq = 4, Hkv = 2, D = 16, L = 6;
  const auto q = torch::randn({B, Hq, S, D}, torch::kBFloat16),
             k = (torch::randn({B, Hkv, S, D}) * 200).to(torch::kBFloat16),
             v = torch::randn({B, Hkv, S, D}, torch::kBFloat16);
  auto kc = torch::zeros({B, Hkv, L, D}, torch::kFloat8_e4m3fn);
  auto vc = torch::zeros({B, Hkv, L, D}, torch::kFloat8_e5m2);
  auto kc32 = torch::zeros({B, Hkv, L, D}), vc32 = torch::zeros({B, Hkv, L, D});
  const auto rope = posenc::ApplyRopeOptions().layout("bhsd").offset(2).interleaved(true);
  posenc::rope_append_kv(q, k, v, kc, vc,
                         posenc::RopeAppendKvOptions().rope(rope).k_scale(0.5).v_scale(torch::tensor({0.25f})));
  posenc::rope_append_kv(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), kc32, vc32,
                         posenc::RopeAppendKvOptions().rope(rope));
  const auto want_k = (kc32 / torch::tensor(0.5f)).clamp(-448, 448).to(torch::kFloat8_e4m3fn);
  const auto want_v = (vc32 / torch::tensor(0.25f)).clamp(-57344, 57344).to(torch::kFloat8_e5m2);
  EXPECT_TRUE(torch::equal(kc.view(torch::kByte), want_k.view(torch::kByte)));
  EXPECT_TRUE(torch::equal(vc.view(torch::kByte), want_v.view(torch::kByte)));
  EXPECT_EQ(kc.to(torch::kFloat).abs().max().item<float>(), 448.0f);  // saturated, not NaN
  EXPECT_THROW(posenc::rope_append_kv(q, k, v, kc, vc, posenc::RopeAppendKvOptions().rope(rope).k_scale(0.0)),
               c10::ValueError);
}

TEST(RopeAppendKv, HuggingFaceStaticCacheInPlace) {
  torch::manual_seed(1);
  const auto q = torch::randn({2, 4, 1, 8}), k = torch::randn({2, 2, 1, 8}),
             v = torch::randn({2, 2, 1, 8});
  auto kc = torch::zeros({2, 2, 5, 8}), vc = torch::zeros({2, 2, 5, 8});
  const auto ref_q = posenc::apply_rope(q, posenc::ApplyRopeOptions().layout("bhsd").offset(3));
  const auto rotated = q.clone();
  posenc::rope_append_kv_(rotated, k, v, kc, vc,
                          posenc::RopeAppendKvOptions().rope(posenc::ApplyRopeOptions().layout("bhsd").offset(3)));
  EXPECT_TRUE(torch::equal(rotated, ref_q));
  EXPECT_TRUE(torch::equal(vc.select(2, 3), v.select(2, 0)));
  EXPECT_EQ(kc.ne(0).sum().item<int64_t>(), kc.select(2, 3).ne(0).sum().item<int64_t>());
}

// QK-norm into the cache (Qwen3-style decoding, Gemma 3's weight_offset): q, the returned k
// and the cache rows are qk_norm_rope's, bit for bit.
TEST(RopeAppendKv, QkNormIntoTheCacheIsQkNormRopes) {
  torch::manual_seed(4);
  const int64_t B = 2, S = 3, Hq = 4, Hkv = 2, D = 16, L = 8;
  const auto q = torch::randn({B, Hq, S, D}, torch::kBFloat16), k = torch::randn({B, Hkv, S, D}, torch::kBFloat16),
             v = torch::randn({B, Hkv, S, D}, torch::kBFloat16);
  const auto wq = torch::rand({D}) + 0.5, wk = torch::rand({D}) + 0.5;  // float32 master weights
  auto kc = torch::zeros({B, Hkv, L, D}, torch::kBFloat16), vc = torch::zeros({B, Hkv, L, D}, torch::kBFloat16);
  const auto rope = posenc::ApplyRopeOptions().layout("bhsd").offset(4);
  auto [out_q, out_k] = posenc::rope_append_kv(
      q, k, v, kc, vc,
      posenc::RopeAppendKvOptions().rope(rope).q_weight(wq).k_weight(wk).weight_offset(1.0).return_k(true));
  auto [ref_q, ref_k] = posenc::qk_norm_rope(q, k, wq, wk, posenc::QkNormRopeOptions().rope(rope).weight_offset(1.0));
  EXPECT_TRUE(torch::equal(out_q, ref_q));
  EXPECT_TRUE(torch::equal(out_k, ref_k));
  EXPECT_TRUE(torch::equal(kc.slice(2, 4, 4 + S), ref_k));
  EXPECT_TRUE(torch::equal(vc.slice(2, 4, 4 + S), v));
  EXPECT_THROW(posenc::rope_append_kv(q, k, v, kc, vc, posenc::RopeAppendKvOptions().rope(rope).q_weight(wq)),
               c10::ValueError);
}

TEST(RopeAppendKv, PagedCacheSkipsMinusOneAndRefusesOutOfRange) {
  torch::manual_seed(2);
  const auto q = torch::randn({3, 2, 8}), k = torch::randn({3, 1, 8}), v = torch::randn({3, 1, 8});
  auto kc = torch::zeros({2, 4, 1, 8}), vc = torch::zeros({2, 4, 1, 8});
  const auto positions = torch::tensor({5, 9, 2}, torch::kLong);
  posenc::rope_append_kv(q, k, v, kc, vc,
                         posenc::RopeAppendKvOptions()
                             .rope(posenc::ApplyRopeOptions().layout("thd").positions(positions))
                             .slot_mapping(torch::tensor({6, -1, 0}, torch::kLong)));
  EXPECT_TRUE(torch::equal(vc[1][2], v[0]));
  EXPECT_TRUE(torch::equal(vc[0][0], v[2]));
  EXPECT_EQ(vc.ne(0).sum().item<int64_t>(), 2 * 8);
  const auto before = kc.clone();
  EXPECT_THROW(posenc::rope_append_kv(q, k, v, kc, vc,
                                      posenc::RopeAppendKvOptions()
                                          .rope(posenc::ApplyRopeOptions().layout("thd"))
                                          .slot_mapping(torch::tensor({1, 8, 0}, torch::kLong))),
               c10::IndexError);
  EXPECT_TRUE(torch::equal(kc, before));
}

}  // namespace

// Issue 34, item 9: rope_append_kv_ streamed its in-place q rows (non-temporal stores over
// lines it had just loaded), which rope's kernel avoids. The rule now lives in one place,
// row_streams (rope_rows.h), asked by rotate_row and copy_row for every row of both
// kernels: a row streams only in a large call and only when written somewhere else than
// where it was read. (Streaming changes no bit, so the kernels' outputs cannot show it; this
// checks the rule the kernels ask.)
TEST(RopeRows, RowsWrittenInPlaceNeverStream) {
  namespace cpu = posenc::ops::cpu;
  float row[8] = {}, other[8] = {};
  EXPECT_FALSE(cpu::row_streams(true, row, row));     // in place: q's rows of rope_append_kv_
  EXPECT_TRUE(cpu::row_streams(true, row, other));    // out of place: a cache row, q's output
  EXPECT_FALSE(cpu::row_streams(false, row, other));  // a small call (below kStreamBytes)
  EXPECT_FALSE(cpu::row_streams(false, row, row));
}

// kv_cache_row, shared by the CPU and CUDA kernels: a per-sequence offset outside [-2**53,
// 2**53] is no row. The CPU op refuses one before its kernel; the CUDA kernel computed
// offset + offsets[b] + s before its assert, a signed overflow (undefined) for one near
// +-2**63 (a review of the CUDA code). Now the sum is formed only inside the domain.
TEST(RopeAppendKv, CacheRowOfAnOffsetOutsideTheDomainIsNone) {
  namespace ops = posenc::ops;
  constexpr int64_t kMax = int64_t{1} << 53;
  int64_t offsets[2] = {0, 4};
  ops::KvCacheArgs a;
  a.offsets = offsets;
  a.max_len = 16;
  a.offset = 3;
  int64_t outer = -1, inner = -1;
  ASSERT_TRUE(ops::kv_cache_row(a, 1, 2, &outer, &inner));
  EXPECT_EQ(outer, 1);
  EXPECT_EQ(inner, 9);
  for (const int64_t bad : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(), kMax + 1,
                            -kMax - 1}) {
    offsets[1] = bad;
    a.offset = bad > 0 ? -kMax : kMax;  // within the host's check; the sum would be near +-2**63 - 2**53
    EXPECT_FALSE(ops::kv_cache_row(a, 1, 0, &outer, &inner)) << bad;
  }
  offsets[1] = kMax;  // the domain's edge: a row when the sum lies in the cache
  a.offset = -kMax + 5;
  ASSERT_TRUE(ops::kv_cache_row(a, 1, 2, &outer, &inner));
  EXPECT_EQ(inner, 7);
}
