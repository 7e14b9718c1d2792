// The KV-cached forward (nn/kv_cache.h) and the decoding loop (generate/generator.h) on tiny random
// models on the CPU, against the full recompute: every step the whole sequence so far goes through
// the training code's evaluation forward (DecoderLayer::forward, the LM head on every row), and
// the last row's logits must equal the cached step's bit for bit, with the same greedy token; the whole generation's cross-entropy from Model::forward equals the one from the cached
// logits; a prompt prefilled in two chunks (attention_kv with several queries) gives the logits of
// one prefill. MoE and dense layers, tied and untied heads, GQA, BF16 and MXFP8 experts.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "generate/generator.h"
#include "nn/decoder_layer.h"
#include "nn/grouped_linear.h"
#include "nn/kv_cache.h"
#include "nn/layer_ops.h"
#include "nn/model.h"
#include "nn/rms_norm.h"

namespace packmoe {
namespace {

// The cached step and the full recompute run the same ops on the same K / V bytes, and every CPU op
// is batch-invariant (a row's bits never depend on how many rows share the call, the GEMM's
// included: backend/cpu/grouped_gemm_cpu.cpp), so the logits agree exactly.

// Layer 0 MoE (4 experts, top-2), layer 1 dense or MoE; weights ~ N(0, 0.2) so the logits spread.
ModelConfig config(bool tied, bool dense_layer) {
  ModelConfig c;
  c.vocab_size = 48;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.moe_intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 40;
  c.num_experts_per_tok = 2;
  c.num_experts = 4;
  if (dense_layer) c.mlp_only_layers = {1};
  c.tie_word_embeddings = tied;
  c.initializer_range = 0.2;
  return c;
}

// The logits (V) of the last of `ids` from the training code's forward over the whole sequence.
std::vector<float> full_logits(Model& model, const std::vector<int32_t>& ids) {
  Backend& b = model.backend();
  const ModelConfig& c = model.config();
  const int64_t S = static_cast<int64_t>(ids.size()), H = c.hidden_size, V = c.vocab_size;
  const int64_t half = c.head_dim / 2;
  Tensor x = Tensor::empty(b, DType::kF32, {S, H});
  EmbeddingArgs e{S, V, H, ids.data(), f32_weight(model.embedding()), x.data_as<float>()};
  EXPECT_TRUE(ops::embedding(b, e).is_ok());
  std::vector<int32_t> positions(S);
  for (int64_t t = 0; t < S; ++t) positions[t] = static_cast<int32_t>(t);
  std::vector<float> cos(S * half), sin(S * half);
  EXPECT_TRUE(rope_table({S, c.head_dim, c.rope_theta, positions.data(), cos.data(), sin.data()})
                  .is_ok());
  PositionTables rope;
  rope.cos = Tensor::view(cos.data(), DType::kF32, {S, half}, Device::kCPU);
  rope.sin = Tensor::view(sin.data(), DType::kF32, {S, half}, Device::kCPU);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) x = model.layer(i).forward(x, 1, S, rope);
  const Tensor logits = model.lm_head().forward(to_bf16(b, model.final_norm().forward(x)), {S});
  const float* last = logits.data_as<const float>() + (S - 1) * V;
  return std::vector<float>(last, last + V);
}

double lse_minus(const std::vector<float>& z, int32_t target) {
  double m = z[0], s = 0;
  for (float v : z) m = std::max(m, static_cast<double>(v));
  for (float v : z) s += std::exp(v - m);
  return std::log(s) + m - z[target];
}

struct Variant {
  bool tied, dense_layer;
  Recipe recipe;
};

class KvCacheVsFullRecompute : public ::testing::TestWithParam<Variant> {};

TEST_P(KvCacheVsFullRecompute, GreedyTokensAndLogits) {
  const Variant p = GetParam();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const ModelConfig c = config(p.tied, p.dense_layer);
  ModelPrecision precision;
  precision.recipe.recipe = p.recipe;
  Model model(cpu_backend(), c, precision, random_model_weights(c, seed));
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(5);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);

  generate::GenerateConfig g;
  g.max_new_tokens = 20;
  std::vector<std::vector<float>> step_logits;
  Result<generate::GenerateResult> r = generate::generate(
      model, prompt, g, [&](int32_t, std::span<const float> z) {
        step_logits.emplace_back(z.begin(), z.end());
      });
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const std::vector<int32_t>& ids = r.value().ids;
  ASSERT_EQ(ids.size(), 20u);
  EXPECT_EQ(r.value().stop, generate::StopReason::kMaxNewTokens);

  std::vector<int32_t> seq = prompt;
  for (size_t n = 0; n < ids.size(); ++n) {
    const std::vector<float> full = full_logits(model, seq);
    ASSERT_EQ(full, step_logits[n]) << "step " << n;
    const int32_t argmax =
        static_cast<int32_t>(std::max_element(full.begin(), full.end()) - full.begin());
    ASSERT_EQ(ids[n], argmax) << "step " << n;
    seq.push_back(ids[n]);
  }

  // The evaluation forward's loss of the generated tokens = the mean of the cached logits'
  // cross-entropies.
  Batch batch;
  batch.batch = 1;
  batch.seq = static_cast<int64_t>(seq.size()) - 1;
  batch.inputs.assign(seq.begin(), seq.end() - 1);
  batch.targets.assign(batch.seq, -100);
  double want = 0;
  for (size_t n = 0; n < ids.size(); ++n) {
    batch.targets[prompt.size() - 1 + n] = ids[n];
    want += lse_minus(step_logits[n], ids[n]) / static_cast<double>(ids.size());
  }
  Result<ForwardLosses> losses = model.forward(batch);
  ASSERT_TRUE(losses.is_ok()) << losses.status().message();
  EXPECT_NEAR(losses.value().lm_loss, want, 1e-4 * std::max(1.0, want));
}

INSTANTIATE_TEST_SUITE_P(Models, KvCacheVsFullRecompute,
                         ::testing::Values(Variant{false, true, Recipe::kBF16},
                                           Variant{true, false, Recipe::kBF16},
                                           Variant{false, false, Recipe::kMxfp8}));

TEST(KvCache, ChunkedPrefillEqualsOnePrefill) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const ModelConfig c = config(false, true);
  Model model(cpu_backend(), c, ModelPrecision{}, random_model_weights(c, seed));
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(11);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % c.vocab_size);
  KvCache one(cpu_backend(), c, 16), two(cpu_backend(), c, 16);
  Result<std::vector<float>> a = forward_cached(model, prompt, one);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  const std::span<const int32_t> all(prompt);
  ASSERT_TRUE(forward_cached(model, all.subspan(0, 4), two).is_ok());
  Result<std::vector<float>> b = forward_cached(model, all.subspan(4), two);  // 7 queries, 11 keys
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  EXPECT_EQ(one.length(), 11);
  EXPECT_EQ(two.length(), 11);
  EXPECT_EQ(a.value(), b.value());
}

TEST(KvCache, ErrorsBeforeComputing) {
  const ModelConfig c = config(false, true);
  Model model(cpu_backend(), c, ModelPrecision{}, random_model_weights(c, 1));
  KvCache cache(cpu_backend(), c, 4);
  const std::vector<int32_t> five = {1, 2, 3, 4, 5}, bad = {1, 48};
  Result<std::vector<float>> r = forward_cached(model, five, cache);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("exceed the cache"), std::string::npos);
  r = forward_cached(model, bad, cache);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("outside the vocabulary"), std::string::npos);
  EXPECT_EQ(cache.length(), 0);

  // generate: a prompt past max_position_embeddings, and stopping at the last position.
  generate::GenerateConfig g;
  g.max_new_tokens = 10;
  const std::vector<int32_t> long_prompt(41, 3), full_prompt(38, 3);
  Result<generate::GenerateResult> out = generate::generate(model, long_prompt, g);
  ASSERT_FALSE(out.is_ok());
  EXPECT_NE(out.status().message().find("max_position_embeddings"), std::string::npos);
  out = generate::generate(model, full_prompt, g);  // positions 38, 39 run; the 3rd token ends it
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  EXPECT_EQ(out.value().ids.size(), 3u);
  EXPECT_EQ(out.value().stop, generate::StopReason::kMaxPositions);
  // An end-of-sequence token stops it (and is emitted).
  Result<generate::GenerateResult> free_run = generate::generate(model, five, g);
  ASSERT_TRUE(free_run.is_ok());
  g.stop_ids = {free_run.value().ids[2]};
  out = generate::generate(model, five, g);
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out.value().stop, generate::StopReason::kEos);
  EXPECT_LE(out.value().ids.size(), 3u);
  EXPECT_EQ(out.value().ids.back(), free_run.value().ids[2]);
}

}  // namespace
}  // namespace packmoe
