// The chunked LM head + cross-entropy (nn/lm_head_loss.h) on the CPU backend, against the unfused
// FP64 reference (tests/common/lm_head_case.h) on fresh random inputs: the loss within 1e-5
// (relative), dh and dW within a relative Frobenius 4e-3 (dlogits are rounded to BF16 once, 2^-9
// relative). The chunk size changes no byte: chunks of 1, 3 and 8 blocks give the same loss, dh
// and main_grad bytes. Ignored targets add nothing; an evaluation call writes no gradient.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

#include "backend/backend.h"
#include "common/lm_head_case.h"

namespace packmoe {
namespace {

using lm_head_case::Case;
using lm_head_case::HeadRun;

uint32_t fresh_seed() { return std::random_device{}(); }

constexpr double kLossTol = 1e-5;
constexpr double kGradTol = 4e-3;

void expect_near_reference(const Case& c, const HeadRun& r) {
  const lm_head_case::Reference ref = lm_head_case::reference(c);
  EXPECT_NEAR(r.loss, ref.loss, kLossTol * std::max(1.0, std::fabs(ref.loss)));
  EXPECT_LE(lm_head_case::rel_error(r.dh, ref.dh), kGradTol);
  EXPECT_LE(lm_head_case::rel_error(r.dw, ref.dw, &c.grad0), kGradTol);
}

// T not a multiple of the block; V > 32 (both R32 stages).
TEST(LmHeadLoss, MatchesTheFp64ReferenceAndChunksChangeNoByte) {
  Backend& b = cpu_backend();
  for (int rep = 0; rep < 3; ++rep) {
    const uint32_t seed = fresh_seed();
    SCOPED_TRACE("random seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    const Case c = lm_head_case::random_case(rng, 300, 72, 40, 0.2);
    const HeadRun one = lm_head_case::run_head(b, c, true, {64, 64});
    expect_near_reference(c, one);
    const HeadRun three = lm_head_case::run_head(b, c, true, {64, 192});
    const HeadRun all = lm_head_case::run_head(b, c, true, {64, 512});  // one chunk of 5 blocks
    EXPECT_TRUE(lm_head_case::same_bytes(one, three));
    EXPECT_TRUE(lm_head_case::same_bytes(one, all));
    // Evaluation: the same loss bytes, main_grad untouched.
    const HeadRun eval = lm_head_case::run_head(b, c, false, {64, 192});
    EXPECT_EQ(std::memcmp(&eval.loss, &one.loss, sizeof(float)), 0);
    EXPECT_TRUE(lm_head_case::same_bytes(eval.dw, c.grad0));
  }
}

// The production block (2048 tokens) over more than one block: the default chunk against a chunk
// of two blocks, and the reference.
TEST(LmHeadLoss, DefaultBlocksAcrossTwoBlocks) {
  Backend& b = cpu_backend();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const Case c = lm_head_case::random_case(rng, kLmHeadBlockTokens + 200, 40, 24, 0.1);
  const HeadRun def = lm_head_case::run_head(b, c, true, {});
  expect_near_reference(c, def);
  const HeadRun two =
      lm_head_case::run_head(b, c, true, {kLmHeadBlockTokens, 2 * kLmHeadBlockTokens});
  EXPECT_TRUE(lm_head_case::same_bytes(def, two));
}

// Ignored tokens: their rows of h change nothing, their dh rows are +0; all ignored: loss +0,
// no gradient (main_grad keeps its bytes).
TEST(LmHeadLoss, IgnoredTargets) {
  Backend& b = cpu_backend();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  Case c = lm_head_case::random_case(rng, 130, 48, 16, 0.5);
  const HeadRun r = lm_head_case::run_head(b, c, true, {32, 64});
  expect_near_reference(c, r);
  Case other = c;
  for (int64_t t = 0; t < c.T; ++t)
    if (c.targets[t] == -100)
      for (int64_t k = 0; k < c.H; ++k) other.h[t * c.H + k] = f32_to_bf16(3.0f);
  const HeadRun r2 = lm_head_case::run_head(b, other, true, {32, 64});
  EXPECT_TRUE(lm_head_case::same_bytes(r, r2));
  for (int64_t t = 0; t < c.T; ++t) {
    if (c.targets[t] != -100) continue;
    for (int64_t k = 0; k < c.H; ++k) EXPECT_EQ(f32_bits(r.dh[t * c.H + k]), 0u);
  }

  c.targets.assign(c.T, -100);
  const HeadRun none = lm_head_case::run_head(b, c, true, {32, 64});
  EXPECT_EQ(none.valid, 0);
  EXPECT_EQ(f32_bits(none.loss), 0u);
  EXPECT_TRUE(lm_head_case::same_bytes(none.dw, c.grad0));
}

// A target outside [0, V): a Status error before anything is written.
TEST(LmHeadLoss, BadTargetIsAnErrorBeforeAnyWrite) {
  Backend& b = cpu_backend();
  std::mt19937 rng(fresh_seed());
  Case c = lm_head_case::random_case(rng, 70, 40, 8, 0.0);
  c.targets[65] = 40;
  auto head = lm_head_case::make_head(b, c);
  const Tensor h = b.to_device(Tensor::view(c.h.data(), DType::kBF16, {c.T, c.H}, Device::kCPU));
  const Result<LmHeadLoss> r = lm_head_loss(*head, h, c.targets, 1.0f, {32, 32});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("target 40 at position 65"), std::string::npos)
      << r.status().message();
  EXPECT_TRUE(
      lm_head_case::same_bytes(lm_head_case::floats(head->main_grad().download()), c.grad0));
}

}  // namespace
}  // namespace packmoe
