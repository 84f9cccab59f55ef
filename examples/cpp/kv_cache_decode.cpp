// A LibTorch app that generates text greedily with a KV cache, through the installed CMake
// package: a tiny decoder (random weights, two attention layers, GQA) rotates q and k and
// appends k and v to a contiguous cache (batch, max_len, kv_heads, head_dim) with one
// posenc::rope_append_kv call per layer and step. Its tokens must equal those of a
// recomputation of the whole sequence without a cache (posenc::apply_rope on every
// position, causal attention) at every step; exits non-zero if not.
#include <posenc/posenc.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

constexpr int64_t kVocab = 64, kModel = 64, kHeads = 4, kKvHeads = 2, kHeadDim = 16;
constexpr int64_t kLayers = 2, kBatch = 3, kPrompt = 5, kNew = 12, kMaxLen = kPrompt + kNew;

struct Layer {
  torch::Tensor wq, wk, wv, wo;
};

struct Decoder {
  torch::Tensor embed, unembed;
  std::vector<Layer> layers;

  Decoder() {
    torch::manual_seed(0);
    const auto opts = torch::TensorOptions().dtype(torch::kDouble);
    const double scale = 1.0 / std::sqrt(static_cast<double>(kModel));
    embed = torch::randn({kVocab, kModel}, opts);
    unembed = torch::randn({kModel, kVocab}, opts) * scale;
    for (int64_t l = 0; l < kLayers; ++l) {
      layers.push_back({torch::randn({kModel, kHeads * kHeadDim}, opts) * scale,
                        torch::randn({kModel, kKvHeads * kHeadDim}, opts) * scale,
                        torch::randn({kModel, kKvHeads * kHeadDim}, opts) * scale,
                        torch::randn({kHeads * kHeadDim, kModel}, opts) * scale});
    }
  }

  // Attention of q (batch, s, heads, d) over k, v (batch, t, kv_heads, d); causal: query i
  // (at position first + i) sees keys 0 .. first + i.
  static torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, int64_t first) {
    const int64_t group = kHeads / kKvHeads;
    const auto kk = k.repeat_interleave(group, 2), vv = v.repeat_interleave(group, 2);
    auto scores = torch::einsum("bshd,bthd->bhst", {q, kk}) / std::sqrt(double(kHeadDim));
    const int64_t s = q.size(1), t = k.size(1);
    const auto allowed = torch::arange(t).unsqueeze(0) <= (torch::arange(s) + first).unsqueeze(1);
    scores = scores.masked_fill(allowed.logical_not(), -INFINITY);
    return torch::einsum("bhst,bthd->bshd", {scores.softmax(-1), vv});
  }

  // Logits of the last token of every row, from the whole sequence (no cache).
  torch::Tensor logits_without_cache(const torch::Tensor& tokens) const {
    auto x = embed.index({tokens});
    const int64_t n = tokens.size(0), s = tokens.size(1);
    for (const Layer& w : layers) {
      auto q = x.matmul(w.wq).view({n, s, kHeads, kHeadDim});
      auto k = x.matmul(w.wk).view({n, s, kKvHeads, kHeadDim});
      const auto v = x.matmul(w.wv).view({n, s, kKvHeads, kHeadDim});
      std::tie(q, k) = posenc::apply_rope(q, k);
      x = x + attend(q, k, v, 0).reshape({n, s, -1}).matmul(w.wo);
    }
    return x.select(1, s - 1).matmul(unembed);
  }

  // The same for the new tokens, appending their k and v to the caches at rows
  // length .. length + s - 1 (one rope_append_kv per layer).
  torch::Tensor logits_with_cache(const torch::Tensor& tokens, int64_t length,
                                  std::vector<torch::Tensor>& k_cache,
                                  std::vector<torch::Tensor>& v_cache) const {
    auto x = embed.index({tokens});
    const int64_t n = tokens.size(0), s = tokens.size(1);
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& w = layers[l];
      const auto q = x.matmul(w.wq).view({n, s, kHeads, kHeadDim});
      const auto k = x.matmul(w.wk).view({n, s, kKvHeads, kHeadDim});
      const auto v = x.matmul(w.wv).view({n, s, kKvHeads, kHeadDim});
      const auto rotated = std::get<0>(posenc::rope_append_kv(
          q, k, v, k_cache[l], v_cache[l], posenc::RopeAppendKvOptions().rope(posenc::ApplyRopeOptions().offset(length))));
      const auto keys = k_cache[l].slice(1, 0, length + s);
      const auto values = v_cache[l].slice(1, 0, length + s);
      x = x + attend(rotated, keys, values, length).reshape({n, s, -1}).matmul(w.wo);
    }
    return x.select(1, s - 1).matmul(unembed);
  }
};

}  // namespace

int main() {
  torch::NoGradGuard no_grad;
  const Decoder model;
  const auto prompt = torch::randint(0, kVocab, {kBatch, kPrompt});
  std::vector<torch::Tensor> k_cache, v_cache;
  for (int64_t l = 0; l < kLayers; ++l) {
    k_cache.push_back(torch::zeros({kBatch, kMaxLen, kKvHeads, kHeadDim}, torch::kDouble));
    v_cache.push_back(torch::zeros({kBatch, kMaxLen, kKvHeads, kHeadDim}, torch::kDouble));
  }
  auto cached = prompt, recomputed = prompt;
  // Prefill: the prompt in one call; then one token per step.
  auto next = model.logits_with_cache(prompt, 0, k_cache, v_cache).argmax(-1, true);
  for (int64_t step = 0; step < kNew; ++step) {
    const auto reference = model.logits_without_cache(recomputed).argmax(-1, true);
    if (!torch::equal(next, reference)) {
      std::printf("kv_cache_decode: step %lld: the cached decoder chose another token than the "
                  "recomputation\n", static_cast<long long>(step));
      return 1;
    }
    cached = torch::cat({cached, next}, 1);
    recomputed = torch::cat({recomputed, reference}, 1);
    if (step + 1 < kNew) {
      next = model.logits_with_cache(next, kPrompt + step, k_cache, v_cache).argmax(-1, true);
    }
  }
  std::printf("kv_cache_decode: %lld tokens per row generated with the KV cache equal the "
              "recomputation without it\n", static_cast<long long>(kNew));
  return 0;
}
