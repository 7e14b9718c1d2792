// A GroupedLinear call in which no local expert gets a token (M = 0: possible under expert
// parallelism): forward gives a (0, N) output, backward a (0, K) dx, and the wgrad leaves
// main_grad as it was when accumulating and zeroes it when overwriting, bitwise, in every recipe
// and with the wgrad direct or delayed. The quantized paths hand the GEMMs copies of null
// pointers (ActivationCopies), which no GEMM may read.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "nn/grouped_linear.h"

namespace packmoe {
namespace {

constexpr int64_t kE = 3, kN = 32, kK = 64;

Tensor random_bf16(Backend& b, std::mt19937& rng, int64_t rows, int64_t cols) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tensor t = Tensor::empty(b, DType::kBF16, {rows, cols});
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<uint16_t>()[i] = f32_to_bf16(dist(rng));
  return t;
}

void step(GroupedLinear& layer, Backend& b, std::mt19937& rng, const std::vector<int64_t>& m,
          GradAccum accum, bool delay) {
  int64_t rows = 0;
  for (int64_t v : m) rows += v;
  const Tensor y = layer.forward(random_bf16(b, rng, rows, kK), m);
  ASSERT_EQ(y.dim(0), rows);
  ASSERT_EQ(y.dim(1), kN);
  const Tensor dx = layer.backward(random_bf16(b, rng, rows, kN), accum);
  ASSERT_EQ(dx.dim(0), rows);
  ASSERT_EQ(dx.dim(1), kK);
  if (delay) layer.backward_dw();
}

TEST(GroupedLinearNoTokens, MainGradKeptOrZeroedInEveryRecipe) {
  Backend& b = cpu_backend();
  for (Recipe r : {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4})
    for (bool delay : {false, true}) {
      SCOPED_TRACE(std::string(recipe_name(r)) + (delay ? " delayed wgrad" : " direct wgrad"));
      std::mt19937 rng(17);
      GroupedLinearConfig cfg;
      cfg.recipe.recipe = r;
      cfg.delay_wgrad = delay;
      Tensor init = Tensor::empty(b, DType::kF32, {kE, kN, kK});
      std::normal_distribution<float> dist(0.0f, 0.1f);
      for (int64_t i = 0; i < init.numel(); ++i) init.data_as<float>()[i] = dist(rng);
      GroupedLinear layer(b, cfg, init);
      step(layer, b, rng, {32, 0, 64}, GradAccum::kOverwrite, delay);  // a main_grad with tokens
      if (HasFatalFailure()) return;
      const std::vector<uint8_t> before = layer.param().main_grad().download();
      bool nonzero = false;
      for (uint8_t v : before) nonzero |= v != 0;
      ASSERT_TRUE(nonzero) << "the step with tokens left main_grad zero";
      step(layer, b, rng, {0, 0, 0}, GradAccum::kAccumulate, delay);
      if (HasFatalFailure()) return;
      EXPECT_EQ(layer.param().main_grad().download(), before) << "accumulating nothing changed it";
      step(layer, b, rng, {0, 0, 0}, GradAccum::kOverwrite, delay);
      if (HasFatalFailure()) return;
      for (uint8_t v : layer.param().main_grad().download())
        ASSERT_EQ(v, 0) << "overwriting with no tokens must give +0";
    }
}

}  // namespace
}  // namespace packmoe
