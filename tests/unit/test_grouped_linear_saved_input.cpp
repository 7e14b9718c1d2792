// What GroupedLinear saves of its BF16 input for the wgrad: an owning tensor by reference (kept
// alive after the caller drops it), a view of someone else's memory by a private copy (the owner
// may reuse it before backward). Either way main_grad equals that of a layer whose input stayed
// untouched, bitwise, with and without a delayed wgrad.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "nn/grouped_linear.h"

namespace packmoe {
namespace {

constexpr int64_t kE = 3, kN = 16, kK = 32;
const std::vector<int64_t> kM = {32, 0, 64};  // (E,) tokens; M = 96

std::vector<uint16_t> random_bf16_bits(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> h(n);
  for (uint16_t& v : h) v = f32_to_bf16(dist(rng));
  return h;
}

Tensor owning_bf16(Backend& b, const std::vector<uint16_t>& h, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty(b, DType::kBF16, {rows, cols});
  b.copy(t.data(), h.data(), t.nbytes(), Backend::CopyKind::kHostToDevice);
  return t;
}

GroupedLinearConfig bf16_config(bool delay) {
  GroupedLinearConfig cfg;
  cfg.recipe = {Recipe::kBF16, false, 0};
  cfg.delay_wgrad = delay;
  return cfg;
}

Tensor random_init(Backend& b) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.1f);
  Tensor init = Tensor::empty(b, DType::kF32, {kE, kN, kK});
  for (int64_t i = 0; i < init.numel(); ++i) init.data_as<float>()[i] = dist(rng);
  return init;
}

// main_grad of one forward / backward on x = x_bits, dy = dy_bits, nothing overwritten.
std::vector<uint8_t> reference_grad(Backend& b, bool delay, const std::vector<uint16_t>& x_bits,
                                    const std::vector<uint16_t>& dy_bits) {
  GroupedLinear layer(b, bf16_config(delay), random_init(b));
  layer.param().create_master();
  layer.forward(owning_bf16(b, x_bits, 96, kK), kM);
  layer.backward(owning_bf16(b, dy_bits, 96, kN), GradAccum::kOverwrite);
  if (delay) layer.backward_dw();
  return layer.param().main_grad().download();
}

class SavedInput : public testing::TestWithParam<bool> {};

TEST_P(SavedInput, ViewInputIsCopiedSoTheOwnersLaterWritesDoNotReachTheWgrad) {
  const bool delay = GetParam();
  Backend& b = cpu_backend();
  std::mt19937 rng(11);
  const std::vector<uint16_t> x_bits = random_bf16_bits(rng, 96 * kK);
  const std::vector<uint16_t> dy_bits = random_bf16_bits(rng, 96 * kN);

  GroupedLinear layer(b, bf16_config(delay), random_init(b));
  layer.param().create_master();
  std::vector<uint16_t> owner = x_bits;  // memory the layer does not own
  layer.forward(Tensor::view(owner.data(), DType::kBF16, {96, kK}, Device::kCPU), kM);
  owner = random_bf16_bits(rng, 96 * kK);  // the owner reuses its buffer before backward
  layer.backward(owning_bf16(b, dy_bits, 96, kN), GradAccum::kOverwrite);
  if (delay) layer.backward_dw();
  EXPECT_TRUE(layer.param().main_grad().download() == reference_grad(b, delay, x_bits, dy_bits));
}

TEST_P(SavedInput, OwningInputOutlivesTheCallersHandle) {
  const bool delay = GetParam();
  Backend& b = cpu_backend();
  std::mt19937 rng(12);
  const std::vector<uint16_t> x_bits = random_bf16_bits(rng, 96 * kK);
  const std::vector<uint16_t> dy_bits = random_bf16_bits(rng, 96 * kN);

  GroupedLinear layer(b, bf16_config(delay), random_init(b));
  layer.param().create_master();
  layer.forward(owning_bf16(b, x_bits, 96, kK), kM);  // the caller's handle ends here
  // New allocations of the same size, filled with other values: had the layer not kept x alive,
  // they could take its memory.
  std::vector<Tensor> others;
  for (int i = 0; i < 4; ++i) others.push_back(owning_bf16(b, random_bf16_bits(rng, 96 * kK), 96, kK));
  layer.backward(owning_bf16(b, dy_bits, 96, kN), GradAccum::kOverwrite);
  if (delay) {
    for (int i = 0; i < 4; ++i) others.push_back(owning_bf16(b, random_bf16_bits(rng, 96 * kN), 96, kN));
    layer.backward_dw();
  }
  EXPECT_TRUE(layer.param().main_grad().download() == reference_grad(b, delay, x_bits, dy_bits));
}

INSTANTIATE_TEST_SUITE_P(Wgrad, SavedInput, testing::Values(false, true),
                         [](const auto& info) { return info.param ? "delayed" : "direct"; });

}  // namespace
}  // namespace packmoe
