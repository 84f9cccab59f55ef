#include <posenc/posenc.h>

#include <iostream>

int main() {
  posenc::PositionalEncoding pe(posenc::PositionalEncodingOptions(512).dropout(0.1));
  torch::Tensor y = pe(torch::randn({2, 100, 512}));
  posenc::RotaryPositionalEncoding rope(posenc::RotaryPositionalEncodingOptions(128).max_len(8192));
  auto [q, k] = rope(torch::randn({2, 100, 32, 128}), torch::randn({2, 100, 8, 128}));
  std::cout << y.sizes() << " " << q.sizes() << " " << k.sizes() << "\n";
}
