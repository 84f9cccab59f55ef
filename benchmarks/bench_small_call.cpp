// The cost of one small call from C++ (the twin of bench_small_call.py): posenc's C++ modules
// and ops at decode sizes against the eager ATen expression, 2000 calls after warm-up, in 10
// interleaved blocks of 200, median of the blocks' mean microseconds per call. Not built by
// CMake (a benchmark, not a test); after `make build`, with torch's include and lib folders:
//
//   T=$(.venv/bin/python -c 'import torch, os; print(os.path.dirname(torch.__file__))')
//   g++ -O2 -std=c++17 benchmarks/bench_small_call.cpp -Ibuild/install/include -I$T/include \
//     -I$T/include/torch/csrc/api/include -Lbuild/install/lib -L$T/lib -Wl,--no-as-needed \
//     -lposenc -ltorch -ltorch_cpu -lc10 -Wl,-rpath,$PWD/build/install/lib:$T/lib \
//     -o build/bench_small_call && build/bench_small_call
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "posenc/posenc.h"

namespace {

using Case = std::pair<std::string, std::function<void()>>;

void time_us(const char* title, const std::vector<Case>& cases, int calls = 2000, int blocks = 10) {
  const int per_block = calls / blocks;
  for (const auto& c : cases) {
    for (int i = 0; i < 200; ++i) c.second();
  }
  std::vector<std::vector<double>> samples(cases.size());
  for (int b = 0; b < blocks; ++b) {
    for (size_t j = 0; j < cases.size(); ++j) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < per_block; ++i) cases[j].second();
      const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - start;
      samples[j].push_back(took.count() / per_block);
    }
  }
  std::printf("\n%s\n", title);
  for (size_t j = 0; j < cases.size(); ++j) {
    std::sort(samples[j].begin(), samples[j].end());
    std::printf("  %-36s %7.2f us\n", cases[j].first.c_str(), samples[j][samples[j].size() / 2]);
  }
}

}  // namespace

int main() {
  std::printf("torch threads: %d\n", at::get_num_threads());
  const torch::Tensor x = torch::randn({1, 1, 512});
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(512).dropout(0.1));
  pe->eval();
  const torch::Tensor table = pe->pe;
  time_us("add-position eval, (1, 1, 512), offset=100",
          {{"PositionalEncoding eval", [&] { pe(x, 100); }},
           {"eager x + pe.slice(1, 100, 101)", [&] { (void)(x + table.slice(1, 100, 101)); }},
           {"x.clone()", [&] { (void)x.clone(); }},
           {"posenc::add_position (op)", [&] { posenc::add_position(x, table, std::nullopt, 100, true, 0.0); }}});

  const torch::Tensor q = torch::randn({1, 1, 32, 128});
  const torch::Tensor k = torch::randn({1, 1, 8, 128});
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(128));
  const auto raw = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("posenc::rope", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           c10::SymInt, const std::optional<at::Tensor>&, double, c10::string_view,
                           at::ArrayRef<double>, int64_t, int64_t, bool, c10::string_view, bool,
                           at::IntArrayRef, c10::string_view)>();
  time_us("RoPE q (1, 1, 32, 128), k (1, 1, 8, 128), offset=100",
          {{"RotaryPositionalEncoding", [&] { rope(q, k, std::nullopt, 100); }},
           {"posenc::apply_rope", [&] { posenc::apply_rope(q, k, posenc::ApplyRopeOptions().offset(100)); }},
           {"raw op posenc::rope (dispatcher)", [&] {
              raw.call(q, k, std::nullopt, std::nullopt, 100, std::nullopt, 10000.0, "default", {}, 0,
                       -1, false, "bshd", false, {}, "axial");
            }}});
  return 0;
}
