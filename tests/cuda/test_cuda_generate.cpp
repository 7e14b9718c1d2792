// Inference on the CUDA backend. (a) attention_kv (backend/ops/model.h) against the CPU reference
// BYTE FOR BYTE over a case table (one decode query or a few new rows after a past; D from 2 to
// 256; GQA groups; up to 3000 cached keys), with sentinel tails (a stray write is a mismatch).
// (b) KV-cached decoding of a tiny random model (nn/kv_cache.h) on the GPU fed the CPU's greedy
// tokens: every step's logits within kCudaLogitBound of the CPU's, and the GPU's greedy choice the
// CPU's wherever the CPU's top-2 margin exceeds twice the bound. Why a bound: the prompt's
// attention is the tensor-core flash kernel (not the CPU's bytes) and the GEMMs sum in another
// order, so BF16 roundings of activations can flip (2^-8 relative). Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "backend/ops/model.h"
#include "common/cuda_vs_cpu.h"
#include "core/codecs.h"
#include "generate/generator.h"
#include "nn/kv_cache.h"
#include "nn/model.h"

namespace packmoe {
namespace {

using test::Tally;
using test::Twin;

std::vector<uint16_t> rand_bf16(size_t n, std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = f32_to_bf16(d(rng));
  return v;
}

TEST(CudaGenerate, AttentionKvEqualsTheCpuBytes) {
  PACKMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t Sq, Skv, Hq, Hkv, D;
  };
  Tally tally("attention_kv");
  for (const Case& c : std::vector<Case>{{1, 1, 1, 1, 2},     {1, 31, 4, 2, 64},
                                         {1, 33, 8, 1, 128},  {1, 3000, 16, 4, 128},
                                         {4, 100, 4, 4, 34},  {7, 7, 2, 1, 256},
                                         {2, 517, 32, 4, 128}, {3, 64, 6, 3, 96}}) {
    SCOPED_TRACE(testing::Message() << "Sq " << c.Sq << " Skv " << c.Skv << " D " << c.D);
    Twin<uint16_t> q(*gpu, rand_bf16(c.Sq * c.Hq * c.D, rng, 2.0f));
    Twin<uint16_t> k(*gpu, rand_bf16(c.Skv * c.Hkv * c.D, rng, 2.0f));
    Twin<uint16_t> v(*gpu, rand_bf16(c.Skv * c.Hkv * c.D, rng, 1.0f));
    Twin<uint16_t> o(*gpu, c.Sq * c.Hq * c.D);
    AttentionKvArgs a;
    a.queries = c.Sq;
    a.keys = c.Skv;
    a.q_heads = c.Hq;
    a.kv_heads = c.Hkv;
    a.head_dim = c.D;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.D)));
    AttentionKvArgs h = a, d = a;
    h.q = q.h(), h.k = k.h(), h.v = v.h(), h.o = o.h();
    d.q = q.d(), d.k = k.d(), d.v = v.d(), d.o = o.d();
    ASSERT_TRUE(attention_kv_cpu(h).is_ok());
    ASSERT_TRUE(ops::attention_kv(*gpu, d).is_ok());
    o.compare(tally, "o");
    ++tally.cases;
  }
}

constexpr float kCudaLogitBound = 0.1f;  // the logits are O(1..5) at this init

TEST(CudaGenerate, CachedDecodingFollowsTheCpu) {
  PACKMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  ModelConfig c;
  c.vocab_size = 96;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 64;
  c.num_experts_per_tok = 2;
  c.num_experts = 4;
  c.mlp_only_layers = {1};
  c.initializer_range = 0.2;
  const ModelWeights w = random_model_weights(c, seed);
  Model cpu(cpu_backend(), c, ModelPrecision{}, w);
  Model cuda(*gpu, c, ModelPrecision{}, w);
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(9);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);

  generate::GenerateConfig g;
  g.max_new_tokens = 24;
  std::vector<std::vector<float>> cpu_logits;
  Result<generate::GenerateResult> r = generate::generate(
      cpu, prompt, g,
      [&](int32_t, std::span<const float> z) { cpu_logits.emplace_back(z.begin(), z.end()); });
  ASSERT_TRUE(r.is_ok()) << r.status().message();

  KvCache cache(*gpu, c, 64);
  Result<std::vector<float>> z = forward_cached(cuda, prompt, cache);
  float worst = 0;
  for (size_t n = 0; n < r.value().ids.size(); ++n) {
    ASSERT_TRUE(z.is_ok()) << z.status().message();
    const std::vector<float>& want = cpu_logits[n];
    for (size_t v = 0; v < want.size(); ++v)
      worst = std::max(worst, std::fabs(z.value()[v] - want[v]));
    std::vector<float> sorted = want;
    std::sort(sorted.rbegin(), sorted.rend());
    const int32_t gpu_choice = static_cast<int32_t>(
        std::max_element(z.value().begin(), z.value().end()) - z.value().begin());
    if (sorted[0] - sorted[1] > 2 * kCudaLogitBound) {
      EXPECT_EQ(gpu_choice, r.value().ids[n]) << n;
    }
    const int32_t next = r.value().ids[n];
    z = forward_cached(cuda, std::span<const int32_t>(&next, 1), cache);
  }
  std::printf("max |cuda - cpu| logit over %zu cached steps: %.3g\n", r.value().ids.size(), worst);
  EXPECT_LE(worst, kCudaLogitBound);
}

}  // namespace
}  // namespace packmoe
