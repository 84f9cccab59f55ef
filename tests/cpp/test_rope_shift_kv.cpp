// GoogleTest: posenc::rope_shift_kv_ (the C++ front end of re-rotating cached keys) against
// apply_rope at the new positions: the contract for a length-scaled type, paged caches with
// skipped slots, FP8 caches against dequantise - rotate - requantise, and the errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "posenc/posenc.h"

namespace {

posenc::RopeScaling longrope() {
  posenc::RopeScaling s;
  s.rope_type = "longrope";
  s.factor = 4.0;
  s.original_max_position_embeddings = 16;
  s.short_factor = {1.0, 1.1, 1.25, 1.5};
  s.long_factor = {2.0, 3.0, 5.0, 9.0};
  return s;
}

// rope_shift_kv_(rope(k, old), old -> new) == rope(k, new), across longrope's short -> long
// switch (a rotation by the position difference would be wrong here).
TEST(RopeShiftKv, ShiftedKeysEqualKeysRotatedAtTheNewPositions) {
  torch::manual_seed(0);
  const int64_t B = 2, L = 12, H = 2, D = 8;
  const auto k = torch::randn({B, L, H, D});
  const auto old_pos = torch::arange(0, L, torch::kLong), new_pos = torch::arange(30, 30 + L, torch::kLong);
  // And every RoPE option reaches the op (apply_rope is held to the formula: test_rope.cpp).
  for (const auto& rope : {posenc::ApplyRopeOptions().scaling(longrope()),
                           posenc::ApplyRopeOptions().base(500.0).interleaved(true),
                           posenc::ApplyRopeOptions().rotary_offset(2).base(1e6),
                           posenc::ApplyRopeOptions().rotary_dim(4).interleaved(true)}) {
    auto cache = posenc::apply_rope(k, posenc::ApplyRopeOptions(rope).positions(old_pos));
    const auto want = posenc::apply_rope(k, posenc::ApplyRopeOptions(rope).positions(new_pos));
    auto out = posenc::rope_shift_kv_(cache, old_pos, new_pos, posenc::RopeShiftKvOptions().rope(rope));
    EXPECT_TRUE(out.is_same(cache));
    EXPECT_TRUE(torch::allclose(cache, want, 3e-6, 3e-6)) << rope.base() << rope.interleaved() << rope.rotary_offset();
  }
}

TEST(RopeShiftKv, PagedCacheSkipsMinusOneSlots) {
  torch::manual_seed(1);
  auto cache = torch::randn({4, 4, 2, 8});
  const auto before = cache.clone();
  const auto slots = torch::tensor({5, -1, 0}, torch::kLong);
  const auto old_pos = torch::tensor({20, 21, 22}, torch::kLong), new_pos = torch::tensor({1, 2, 3}, torch::kLong);
  const auto rope = posenc::ApplyRopeOptions().layout("thd").interleaved(true);
  posenc::rope_shift_kv_(cache, old_pos, new_pos, posenc::RopeShiftKvOptions().rope(rope).slot_mapping(slots));
  const auto flat = cache.view({16, 2, 8}), flat0 = before.view({16, 2, 8});
  for (const int64_t i : {0, 1}) {  // items 0 and 2: slots 5 and 0
    const int64_t slot = i == 0 ? 5 : 0, item = i == 0 ? 0 : 2;
    const auto x = flat0[slot].unsqueeze(0).unsqueeze(0);
    auto back = posenc::apply_rope(x, posenc::ApplyRopeOptions().interleaved(true).inverse(true)
                                          .positions(old_pos.slice(0, item, item + 1)));
    auto want = posenc::apply_rope(back, posenc::ApplyRopeOptions().interleaved(true)
                                             .positions(new_pos.slice(0, item, item + 1)));
    EXPECT_TRUE(torch::allclose(flat[slot], want[0][0], 3e-6, 3e-6));
  }
  for (int64_t s = 0; s < 16; ++s) {
    if (s != 5 && s != 0) EXPECT_TRUE(torch::equal(flat[s], flat0[s])) << s;
  }
}

// FP8: the float32 cache's shift, quantised, bit for bit; a scale as a double.
TEST(RopeShiftKv, Float8CacheIsDequantiseRotateRequantise) {
  torch::manual_seed(2);
  auto cache = (torch::randn({2, 6, 2, 16}) * 10).to(torch::kFloat8_e4m3fn);
  const auto old_pos = torch::tensor({9, 10, 11}, torch::kLong), new_pos = torch::tensor({0, 1, 2}, torch::kLong);
  const auto rows = torch::tensor({{1, 2, 3}, {5, 4, 0}}, torch::kLong);
  auto f32 = cache.to(torch::kFloat) * torch::tensor(0.5f);
  posenc::rope_shift_kv_(f32, old_pos, new_pos, posenc::RopeShiftKvOptions().rows(rows));
  const auto want = (f32 / torch::tensor(0.5f)).clamp(-448, 448).to(torch::kFloat8_e4m3fn);
  posenc::rope_shift_kv_(cache, old_pos, new_pos, posenc::RopeShiftKvOptions().rows(rows).k_scale(0.5));
  EXPECT_TRUE(torch::equal(cache.view(torch::kByte), want.view(torch::kByte)));
}

TEST(RopeShiftKv, ErrorsWriteNothing) {
  auto cache = torch::randn({1, 4, 1, 8});
  const auto before = cache.clone();
  const auto p = torch::tensor({1, 2}, torch::kLong);
  EXPECT_THROW(posenc::rope_shift_kv_(cache, p, p, posenc::RopeShiftKvOptions().rows(torch::tensor({0, 4}, torch::kLong))),
               c10::IndexError);
  EXPECT_THROW(posenc::rope_shift_kv_(cache, p, p, posenc::RopeShiftKvOptions().rows(torch::tensor({3, 3}, torch::kLong))),
               c10::ValueError);
  EXPECT_THROW(posenc::rope_shift_kv_(cache, p, p, posenc::RopeShiftKvOptions().rope(posenc::ApplyRopeOptions().offset(2))),
               c10::ValueError);
  EXPECT_TRUE(torch::equal(cache, before));
}

}  // namespace
