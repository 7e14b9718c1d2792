// What GroupedLinear saves of its BF16 input for the wgrad: an owning tensor by reference (kept
// alive after the caller drops it), a view of someone else's memory by a private copy (the owner
// may reuse it before backward). Either way main_grad equals that of a layer whose input stayed
// untouched, bitwise, with and without a delayed wgrad.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
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

// main_grad after one forward on x and one backward on dy (the wgrad direct or delayed). The
// handle to x passed in is dropped right after forward, as a caller's temporary would be;
// `meanwhile` runs between forward and backward, and again before a delayed wgrad.
std::vector<uint8_t> wgrad_of(Backend& b, bool delay, Tensor x, const std::vector<uint16_t>& dy_bits,
                              const std::function<void()>& meanwhile) {
  GroupedLinear layer(b, bf16_config(delay), random_init(b));
  layer.forward(x, kM);
  x = Tensor{};
  meanwhile();
  layer.backward(owning_bf16(b, dy_bits, 96, kN), GradAccum::kOverwrite);
  if (delay) {
    meanwhile();
    layer.backward_dw();
  }
  return layer.param().main_grad().download();
}

// Param: the wgrad is delayed (backward_dw) or direct.
class SavedInput : public testing::TestWithParam<bool> {
 protected:
  Backend& b = cpu_backend();
  std::mt19937 rng{11};
  const std::vector<uint16_t> x_bits = random_bf16_bits(rng, 96 * kK);
  const std::vector<uint16_t> dy_bits = random_bf16_bits(rng, 96 * kN);
  const bool delay = GetParam();
};

TEST_P(SavedInput, ViewInputIsCopiedSoTheOwnersLaterWritesDoNotReachTheWgrad) {
  std::vector<uint16_t> owner = x_bits;  // memory the layer does not own
  const Tensor view = Tensor::view(owner.data(), DType::kBF16, {96, kK}, Device::kCPU);
  // The owner reuses its buffer before backward.
  const auto got = wgrad_of(b, delay, view, dy_bits, [&] { owner = random_bf16_bits(rng, 96 * kK); });
  EXPECT_TRUE(got == wgrad_of(b, delay, owning_bf16(b, x_bits, 96, kK), dy_bits, [] {}));
}

TEST_P(SavedInput, OwningInputOutlivesTheCallersHandle) {
  // New allocations of x's size, filled with other values: had the layer not kept x alive, they
  // could take its memory.
  std::vector<Tensor> others;
  const auto got = wgrad_of(b, delay, owning_bf16(b, x_bits, 96, kK), dy_bits, [&] {
    for (int i = 0; i < 4; ++i) others.push_back(owning_bf16(b, random_bf16_bits(rng, 96 * kK), 96, kK));
  });
  EXPECT_TRUE(got == wgrad_of(b, delay, owning_bf16(b, x_bits, 96, kK), dy_bits, [] {}));
}

INSTANTIATE_TEST_SUITE_P(Wgrad, SavedInput, testing::Values(false, true),
                         [](const auto& info) { return info.param ? "delayed" : "direct"; });

}  // namespace
}  // namespace packmoe
