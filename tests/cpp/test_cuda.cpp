// GoogleTest: the C++ modules on CUDA against the same modules on the CPU. Skipped without
// a GPU; scripts/gpu_check.sh builds and runs them on the device.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "posenc/posenc.h"

namespace {

#define POSENC_REQUIRE_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA GPU"

TEST(Cuda, PositionalEncodingMatchesTheCpu) {
  POSENC_REQUIRE_CUDA();
  torch::manual_seed(0);
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(64).max_len(128).dropout(0.3));
  pe->eval();
  auto x = torch::randn({4, 100, 64});
  auto pos = torch::randint(0, 128, {4, 100}, torch::kLong);
  auto y_cpu = pe->forward(x, 5);
  auto yp_cpu = pe->forward(x, 0, pos);
  pe->to(torch::kCUDA);
  // The same float32 sum, rounded once: equal to the bit.
  EXPECT_TRUE(torch::equal(pe->forward(x.cuda(), 5).cpu(), y_cpu));
  EXPECT_TRUE(torch::equal(pe->forward(x.cuda(), 0, pos.cuda()).cpu(), yp_cpu));
  EXPECT_THROW(pe->forward(x.cuda(), 0, (pos + 128).cuda()), c10::IndexError);

  // Training: the backward regenerates the forward's mask (x + pe > 0 everywhere, so an
  // output is zero exactly where dropout zeroed it).
  pe->train();
  auto xg = (x.abs() + 2.0).cuda().requires_grad_(true);
  auto y = pe->forward(xg);
  y.backward(torch::ones_like(y));
  const auto kept = y.detach() != 0;
  const double dropped = 1.0 - kept.to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(dropped, 0.3, 4 * std::sqrt(0.3 * 0.7 / y.numel()));
  EXPECT_TRUE(torch::equal(xg.grad() != 0, kept));
  EXPECT_TRUE(torch::allclose(xg.grad().masked_select(kept),
                              torch::full({kept.sum().item<int64_t>()}, 1.0 / 0.7, xg.options()),
                              1e-6, 1e-6));
}

TEST(Cuda, LearnedTableGradientMatchesTheCpu) {
  POSENC_REQUIRE_CUDA();
  torch::manual_seed(1);
  auto options = posenc::LearnedPositionalEncodingOptions(32).max_len(50).dropout(0.0);
  posenc::LearnedPositionalEncoding cpu(options), gpu(options);
  {
    torch::NoGradGuard no_grad;
    gpu->pe.copy_(cpu->pe);
  }
  gpu->to(torch::kCUDA);
  // (batch, seq) positions with repeats, and (seq,) positions: the two CUDA kernels.
  for (auto pos : {torch::randint(0, 50, {3, 20}, torch::kLong), torch::randint(0, 50, {20}, torch::kLong)}) {
    cpu->pe.mutable_grad() = torch::Tensor();
    gpu->pe.mutable_grad() = torch::Tensor();
    auto x = torch::randn({3, 20, 32});
    auto g = torch::randn({3, 20, 32});
    cpu->forward(x, 0, pos).backward(g);
    gpu->forward(x.cuda(), 0, pos.cuda()).backward(g.cuda());
    EXPECT_TRUE(torch::allclose(gpu->pe.grad().cpu(), cpu->pe.grad(), 1e-5, 1e-5)) << pos.sizes();
  }
}

TEST(Cuda, RotaryMatchesTheCpu) {
  POSENC_REQUIRE_CUDA();
  torch::manual_seed(2);
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(64).max_len(256));
  auto q = torch::randn({2, 33, 4, 64});
  auto k = torch::randn({2, 33, 2, 64});
  auto [qc, kc] = rope(q, k, std::nullopt, 7);
  auto [qg, kg] = rope(q.cuda(), k.cuda(), std::nullopt, 7);
  EXPECT_TRUE(torch::allclose(qg.cpu(), qc, 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(kg.cpu(), kc, 1e-5, 1e-5));
  // Packed sequences with per-sequence offsets, in place.
  auto qt = torch::randn({30, 4, 64});
  auto cu = torch::tensor({0, 12, 12, 30}, torch::kInt);
  auto offsets = torch::tensor({3, 100, 9}, torch::kLong);
  auto opts = posenc::ApplyRopeOptions().layout("thd").cu_seqlens(cu).offsets(offsets);
  auto want = posenc::apply_rope(qt, opts);
  auto qt_cuda = qt.cuda();
  posenc::apply_rope_(qt_cuda, std::nullopt,
                      posenc::ApplyRopeOptions().layout("thd").cu_seqlens(cu.cuda()).offsets(offsets.cuda()));
  EXPECT_TRUE(torch::allclose(qt_cuda.cpu(), want, 1e-5, 1e-5));
}

}  // namespace

namespace {

// torch::load(module, path, torch::kCUDA) moves a CPU module's tensors to the GPU, cast to
// the module's dtype, as LibTorch's load moves any module's (posenc's load copies on one
// device and follows the archive's device across them).
TEST(Cuda, LoadOntoTheGpuMovesAndCasts) {
  POSENC_REQUIRE_CUDA();
  const std::string path = ::testing::TempDir() + "posenc_cuda_load.pt";
  posenc::PositionalEncoding saved(posenc::PositionalEncodingOptions(8).max_len(16));
  saved->to(torch::kDouble);
  saved->reset();
  torch::save(saved, path);
  posenc::PositionalEncoding m(posenc::PositionalEncodingOptions(8).max_len(16));
  torch::load(m, path, torch::kCUDA);
  std::remove(path.c_str());
  EXPECT_TRUE(m->pe.is_cuda());
  EXPECT_EQ(m->pe.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(m->pe.cpu(), saved->pe.to(torch::kFloat)));
  EXPECT_EQ(m->named_buffers()["pe"].data_ptr(), m->pe.data_ptr());
}

}  // namespace
