// Learning-rate schedule against hand-computed values, TrainConfig validation and its "train"
// JSON object (unknown keys and wrong types are one-line errors naming the key), and the model
// FLOPs formula against a hand count.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "train/lr_schedule.h"
#include "train/model_config.h"
#include "train/throughput.h"
#include "train/train_config.h"

namespace packmoe::train {
namespace {

TEST(LrSchedule, WarmupThenCosineThenConstant) {
  const LrSchedule s{1e-3, 1e-4, /*warmup=*/10, /*decay=*/110};
  EXPECT_DOUBLE_EQ(s.at(1), 1e-4);   // 1e-3 * 1 / 10
  EXPECT_DOUBLE_EQ(s.at(5), 5e-4);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);  // peak at the end of warmup
  // step 35: ratio (35 - 10) / 100 = 1/4, 1e-4 + 9e-4 * (1 + cos(pi/4)) / 2 = 8.68198051533946e-4
  EXPECT_NEAR(s.at(35), 8.68198051533946e-4, 1e-17);
  EXPECT_NEAR(s.at(60), 5.5e-4, 1e-17);  // ratio 1/2: halfway
  // step 85: ratio 3/4, 1e-4 + 9e-4 * (1 - cos(pi/4)) / 2 = 2.31801948466054e-4
  EXPECT_NEAR(s.at(85), 2.31801948466054e-4, 1e-17);
  EXPECT_DOUBLE_EQ(s.at(110), 1e-4);  // cosine ends at min_lr
  EXPECT_DOUBLE_EQ(s.at(111), 1e-4);
  EXPECT_DOUBLE_EQ(s.at(100000), 1e-4);
  for (int64_t t = 11; t <= 110; ++t) EXPECT_LE(s.at(t), s.at(t - 1) + 1e-18) << t;
}

TEST(LrSchedule, NoWarmupAndDecayInsideWarmup) {
  const LrSchedule cosine{2.0, 0.0, 0, 4};
  EXPECT_NEAR(cosine.at(1), 1 + std::cos(M_PI / 4), 1e-15);  // 2 * (1 + cos(pi/4)) / 2
  EXPECT_NEAR(cosine.at(2), 1.0, 1e-15);
  EXPECT_NEAR(cosine.at(4), 0.0, 1e-15);
  const LrSchedule short_decay{1.0, 0.5, 10, 5};  // D <= W: warmup, then min_lr
  EXPECT_DOUBLE_EQ(short_decay.at(10), 1.0);
  EXPECT_DOUBLE_EQ(short_decay.at(11), 0.5);
}

TEST(LrSchedule, ValidationNamesTheField) {
  EXPECT_TRUE(validate(LrSchedule{1e-3, 1e-4, 0, 1}).is_ok());
  EXPECT_NE(validate(LrSchedule{-1, 0, 0, 1}).message().find("lr = -1"), std::string::npos);
  EXPECT_NE(validate(LrSchedule{1e-3, 1e-2, 0, 1}).message().find("min_lr"), std::string::npos);
  EXPECT_NE(validate(LrSchedule{NAN, 0, 0, 1}).message().find("lr"), std::string::npos);
  EXPECT_NE(validate(LrSchedule{1e-3, 0, -1, 1}).message().find("warmup_steps"), std::string::npos);
  EXPECT_NE(validate(LrSchedule{1e-3, 0, 0, 0}).message().find("decay_steps"), std::string::npos);
}

TEST(TrainConfig, DefaultsAreValidAndBadValuesAreNamed) {
  const ModelConfig tiny = model_config_preset("tiny").value();
  EXPECT_TRUE(validate(TrainConfig{}, tiny).is_ok());
  auto error = [&](auto change) {
    TrainConfig c;
    change(c);
    return validate(c, tiny).message();
  };
  EXPECT_EQ(error([](TrainConfig& c) { c.micro_batch_size = 0; }), "micro_batch_size = 0 must be >= 1");
  EXPECT_NE(error([](TrainConfig& c) { c.seq_len = 100000; }).find("max_position_embeddings"),
            std::string::npos);
  EXPECT_NE(error([](TrainConfig& c) { c.beta2 = 1.0; }).find("beta2"), std::string::npos);
  EXPECT_NE(error([](TrainConfig& c) { c.grad_clip = NAN; }).find("grad_clip"), std::string::npos);
  EXPECT_NE(error([](TrainConfig& c) { c.eval_batches = 0; }).find("eval_batches"), std::string::npos);
  EXPECT_TRUE(error([](TrainConfig& c) { c.eval_batches = 0, c.eval_interval = 0; }).empty());
  EXPECT_NE(error([](TrainConfig& c) { c.min_lr = 1.0; }).find("min_lr"), std::string::npos);
  // NVFP4 numbers its gradient SR draws by step and micro-batch (nvfp4_grad_sr_offset): the
  // limits hold for NVFP4 only.
  const auto nvfp4 = [&](int64_t steps, int64_t accum) {
    return error([&](TrainConfig& c) {
      c.precision.recipe.recipe = Recipe::kNvfp4;
      c.steps = steps;
      c.grad_accum_steps = accum;
    });
  };
  EXPECT_TRUE(nvfp4((1 << 24) - 1, 4096).empty());
  EXPECT_EQ(nvfp4(1 << 24, 1), "NVFP4: steps must be below 2^24 (its stochastic rounding numbers the steps' draws)");
  EXPECT_NE(nvfp4(10, 4097).find("NVFP4: grad_accum_steps must be at most 2^12"), std::string::npos);
  EXPECT_TRUE(error([](TrainConfig& c) { c.steps = 1 << 24, c.grad_accum_steps = 4097; }).empty());
  // --dispatch-dtype recipe: a quantized recipe's rows, under expert parallelism only.
  const auto dispatch = [&](Recipe recipe, int64_t ep) {
    return error([&](TrainConfig& c) {
      c.precision.recipe.recipe = recipe;
      c.expert_parallel = ep;
      c.dispatch_dtype = DispatchDtype::kRecipe;
    });
  };
  EXPECT_TRUE(dispatch(Recipe::kMxfp8, 2).empty());
  EXPECT_TRUE(dispatch(Recipe::kNvfp4, 4).empty());
  EXPECT_NE(dispatch(Recipe::kBF16, 2).find("needs the mxfp8 or nvfp4 recipe"), std::string::npos);
  EXPECT_NE(dispatch(Recipe::kMxfp8, 1).find("needs expert parallelism"), std::string::npos);
  EXPECT_EQ(lr_schedule(TrainConfig{}).decay_steps, TrainConfig{}.steps);
}

TEST(TrainConfig, JsonOverwritesOnlyTheGivenKeys) {
  TrainConfig c;
  const auto j = nlohmann::json::parse(
      R"({"steps": 7, "lr": 0.5, "decay_steps": 5, "seed": 9, "recipe": "nvfp4",
          "layout": "discrete", "primary": "high", "gather_mode": "lowp",
          "recompute": "selective", "dispatch_dtype": "recipe"})");
  ASSERT_TRUE(apply_train_json(j, &c).is_ok());
  EXPECT_EQ(c.steps, 7);
  EXPECT_EQ(c.lr, 0.5);
  EXPECT_EQ(c.decay_steps, 5);
  EXPECT_EQ(c.seed, 9u);
  EXPECT_EQ(c.precision.recipe.recipe, Recipe::kNvfp4);
  EXPECT_EQ(c.precision.layout, Layout::kDiscrete);
  EXPECT_EQ(c.precision.primary, PrimaryWeight::kHighPrecision);
  EXPECT_EQ(c.gather_mode, GatherMode::kLowp);
  EXPECT_EQ(c.recompute, Recompute::kSelective);
  EXPECT_EQ(c.dispatch_dtype, DispatchDtype::kRecipe);
  EXPECT_EQ(train_config_to_json(c)["dispatch_dtype"], "recipe");
  EXPECT_EQ(c.micro_batch_size, TrainConfig{}.micro_batch_size);

  auto error = [](const char* text) {
    TrainConfig c;
    return apply_train_json(nlohmann::json::parse(text), &c).message();
  };
  EXPECT_EQ(error(R"({"stpes": 3})"), "unknown key train.stpes");
  EXPECT_EQ(error(R"({"steps": 1.5})"), "train.steps must be an integer (got 1.5)");
  EXPECT_EQ(error(R"({"lr": "fast"})"), "train.lr must be a number (got \"fast\")");
  EXPECT_EQ(error(R"({"seed": -1})"), "train.seed must be a non-negative integer (got -1)");
  EXPECT_EQ(error(R"({"recipe": "fp8"})"), "recipe must be bf16, mxfp8 or nvfp4 (got 'fp8')");
  EXPECT_EQ(error(R"({"recompute": "all"})"),
            "recompute must be none, selective or full (got 'all')");
  EXPECT_EQ(error(R"({"dispatch_dtype": "fp8"})"),
            "dispatch_dtype must be bf16 or recipe (got 'fp8')");
  EXPECT_EQ(error(R"({"gather_mode": "fp8"})"),
            "unknown parameter gather mode 'fp8' (bf16, lowp, reuse-grad-buffer)");
  EXPECT_NE(error(R"([1, 2])").find("must be a JSON object"), std::string::npos);
}

TEST(ModelFlops, HandCountOfTheTinyPreset) {
  const ModelConfig m = model_config_preset("tiny").value();
  // tiny: V 256, H 64, 2 MoE layers, Hq 4, Hkv 2, D 16, E 4, k 2, F 32.
  const double per_layer = 64.0 * 64 + 2 * 64 * 32 + 64 * 64  // q, k, v, o
                           + 4 * 64                           // router
                           + 2 * 3 * 32 * 64;                 // 2 active experts, gate/up/down
  const double matmul = 2 * per_layer + 256.0 * 64;           // + lm_head
  EXPECT_DOUBLE_EQ(model_flops_per_token(m, 128), 6 * matmul + 12.0 * 2 * 128 * 4 * 16);
}

}  // namespace
}  // namespace packmoe::train
