// Model bookkeeping (nn/model.h) on a 2-layer config: model_param_specs against a hand-written list
// of Hugging Face names and shapes, random_model_weights' determinism, validate_model_weights'
// one-line errors naming the tensor, and Model::forward's Status error for a bad token id or
// target (before anything runs: the model stays idle and a good batch still works).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "nn/model.h"

namespace packmoe {
namespace {

// V = 40, H = 32, D = 16 with Hq = 4 (so Hq * D = 64 != H), Hkv = 2, E = 4, F = 16, I = 48;
// layer 0 MoE, layer 1 dense.
ModelConfig two_layer_config(bool tied) {
  ModelConfig c;
  c.vocab_size = 40;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.moe_intermediate_size = 16;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 64;
  c.num_experts_per_tok = 2;
  c.num_experts = 4;
  c.mlp_only_layers = {1};
  c.tie_word_embeddings = tied;
  return c;
}

std::vector<ParamSpec> expected_specs(bool tied) {
  const ParamInit N = ParamInit::kNormal, O = ParamInit::kOnes;
  std::vector<ParamSpec> s = {
      {"model.embed_tokens.weight", {40, 32}, N, true},
      {"model.layers.0.input_layernorm.weight", {32}, O, false},
      {"model.layers.0.self_attn.q_proj.weight", {64, 32}, N, true},
      {"model.layers.0.self_attn.k_proj.weight", {32, 32}, N, true},
      {"model.layers.0.self_attn.v_proj.weight", {32, 32}, N, true},
      {"model.layers.0.self_attn.o_proj.weight", {32, 64}, N, true},
      {"model.layers.0.self_attn.q_norm.weight", {16}, O, false},
      {"model.layers.0.self_attn.k_norm.weight", {16}, O, false},
      {"model.layers.0.post_attention_layernorm.weight", {32}, O, false},
      {"model.layers.0.mlp.gate.weight", {4, 32}, N, true},
      {"model.layers.0.mlp.experts.gate_up_proj", {4, 32, 32}, N, true},
      {"model.layers.0.mlp.experts.down_proj", {4, 32, 16}, N, true},
      {"model.layers.1.input_layernorm.weight", {32}, O, false},
      {"model.layers.1.self_attn.q_proj.weight", {64, 32}, N, true},
      {"model.layers.1.self_attn.k_proj.weight", {32, 32}, N, true},
      {"model.layers.1.self_attn.v_proj.weight", {32, 32}, N, true},
      {"model.layers.1.self_attn.o_proj.weight", {32, 64}, N, true},
      {"model.layers.1.self_attn.q_norm.weight", {16}, O, false},
      {"model.layers.1.self_attn.k_norm.weight", {16}, O, false},
      {"model.layers.1.post_attention_layernorm.weight", {32}, O, false},
      {"model.layers.1.mlp.gate_up_proj", {96, 32}, N, true},
      {"model.layers.1.mlp.down_proj.weight", {32, 48}, N, true},
      {"model.norm.weight", {32}, O, false},
  };
  if (!tied) s.push_back({"lm_head.weight", {40, 32}, N, true});
  return s;
}

TEST(Model, ParamSpecsHaveHuggingFaceNamesShapesAndOrder) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const std::vector<ParamSpec> got = model_param_specs(two_layer_config(tied));
    const std::vector<ParamSpec> want = expected_specs(tied);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].name, want[i].name) << "spec " << i;
      EXPECT_EQ(got[i].shape, want[i].shape) << want[i].name;
      EXPECT_EQ(got[i].init, want[i].init) << want[i].name;
      EXPECT_EQ(got[i].weight_decay, want[i].weight_decay) << want[i].name;
    }
  }
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

TEST(Model, RandomWeightsAreDeterministicPerSeed) {
  const ModelConfig c = two_layer_config(false);
  const ModelWeights a = random_model_weights(c, 11), b = random_model_weights(c, 11);
  const ModelWeights other = random_model_weights(c, 12);
  EXPECT_TRUE(validate_model_weights(c, a).is_ok()) << validate_model_weights(c, a).message();
  for (const ParamSpec& s : model_param_specs(c)) {
    SCOPED_TRACE(s.name);
    const Tensor& t = a.at(s.name);
    EXPECT_TRUE(same_bytes(t, b.at(s.name))) << "same seed, different weights";
    const float* p = t.data_as<const float>();
    if (s.init == ParamInit::kOnes) {
      for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(p[i], 1.0f) << "norm element " << i;
      continue;
    }
    EXPECT_FALSE(same_bytes(t, other.at(s.name))) << "another seed, same weights";
    // N(0, initializer_range): the sample mean and standard deviation lie within 5 standard errors
    // (sigma / sqrt(n), sigma / sqrt(2n)) of it.
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      sum += p[i];
      sq += double(p[i]) * p[i];
    }
    const double n = static_cast<double>(t.numel()), sigma = c.initializer_range;
    const double mean = sum / n, sd = std::sqrt(sq / n - mean * mean);
    EXPECT_NEAR(mean, 0.0, 5 * sigma / std::sqrt(n));
    EXPECT_NEAR(sd, sigma, 5 * sigma / std::sqrt(2 * n));
  }
}

// The error is one line that names `name`.
void expect_error_naming(const Status& s, const std::string& name) {
  ASSERT_FALSE(s.is_ok()) << "accepted a map with a bad " << name;
  EXPECT_NE(s.message().find(name), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << s.message();
}

TEST(Model, ValidateWeightsNamesTheOffendingTensor) {
  const ModelConfig c = two_layer_config(false);
  const ModelWeights good = random_model_weights(c, 5);

  ModelWeights missing = good;
  missing.erase("model.layers.1.mlp.down_proj.weight");
  expect_error_naming(validate_model_weights(c, missing), "model.layers.1.mlp.down_proj.weight");

  // An HF per-expert key where the packed one is expected.
  ModelWeights extra = good;
  extra.emplace("model.layers.0.mlp.experts.0.gate_proj.weight",
                Tensor::empty(cpu_backend(), DType::kF32, {16, 32}));
  expect_error_naming(validate_model_weights(c, extra),
                      "model.layers.0.mlp.experts.0.gate_proj.weight");

  ModelWeights shape = good;
  shape["model.layers.0.self_attn.k_proj.weight"] =
      Tensor::empty(cpu_backend(), DType::kF32, {64, 32});
  expect_error_naming(validate_model_weights(c, shape), "model.layers.0.self_attn.k_proj.weight");

  ModelWeights dtype = good;
  dtype["model.norm.weight"] = Tensor::empty(cpu_backend(), DType::kBF16, {32});
  expect_error_naming(validate_model_weights(c, dtype), "model.norm.weight");

  // A tied config has no lm_head.
  const ModelConfig tied = two_layer_config(true);
  expect_error_naming(validate_model_weights(tied, good), "lm_head.weight");
}

TEST(Model, ForwardRejectsBadIdsAndTargets) {
  const ModelConfig c = two_layer_config(false);
  Model model(cpu_backend(), c, ModelPrecision{}, random_model_weights(c, 3));
  const int64_t B = 2, S = 4;
  const Batch good{B, S, {1, 2, 3, 4, 5, 6, 7, 39}, {2, 3, 4, -100, 6, 7, 39, -100}, {}, {}};
  auto with = [&](bool input, int64_t i, int32_t v) {
    Batch b = good;
    (input ? b.inputs : b.targets)[i] = v;
    return b;
  };
  const struct {
    const char* what;
    Batch batch;
  } bad[] = {
      {"input id = V", with(true, 5, 40)},
      {"negative input id", with(true, 0, -1)},
      {"target = V", with(false, 2, 40)},
      {"negative target other than -100", with(false, 4, -2)},
  };
  for (const auto& b : bad) {
    for (const Result<ForwardLosses>& r : {model.forward(b.batch), model.forward(b.batch, 1.0f)}) {
      EXPECT_FALSE(r.is_ok()) << b.what << " accepted";
      if (!r.is_ok()) {
        EXPECT_FALSE(r.status().message().empty()) << b.what;
      }
      EXPECT_EQ(model.state(), ModelState::kIdle) << b.what << ": a rejected batch left state";
    }
  }
  // An evaluation forward owes no backward; a training forward does.
  const Result<ForwardLosses> eval = model.forward(good);
  ASSERT_TRUE(eval.is_ok()) << eval.status().message();
  EXPECT_EQ(model.state(), ModelState::kIdle);
  const Result<ForwardLosses> ok = model.forward(good, 1.0f);
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  EXPECT_EQ(ok.value().target_tokens, 6);
  EXPECT_TRUE(std::isfinite(ok.value().lm_loss));
  EXPECT_EQ(std::memcmp(&ok.value().lm_loss, &eval.value().lm_loss, sizeof(float)), 0);
  EXPECT_EQ(model.state(), ModelState::kForwardDone);
}

}  // namespace
}  // namespace packmoe
