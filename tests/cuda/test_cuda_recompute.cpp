// Activation recomputation (nn/recompute.h) on the CUDA backend: selective and full give bitwise
// the run of none (tests/common/recompute_checks.h: losses, aux losses, grad norms, FP32 masters
// and AdamW moments after 3 steps) in each recipe, grad-accum 1 and 2, tied and untied heads, MoE
// and dense layers, causal and document-masked rows. A run of none is first checked to repeat
// itself bit for bit, so a failure below it is the recomputation's. Skips without a GPU.
#include <gtest/gtest.h>

#include <random>

#include "backend/backend.h"
#include "common/recompute_checks.h"

namespace packmoe {
namespace {

using testing::RecomputeCase;

Backend* gpu_or_null() {
  Result<Backend*> b = get_backend(Device::kCUDA);
  return b.is_ok() ? b.value() : nullptr;
}

class CudaRecomputeVsNone : public ::testing::TestWithParam<RecomputeCase> {};

TEST_P(CudaRecomputeVsNone, SameBytes) {
  Backend* gpu = gpu_or_null();
  if (!gpu) GTEST_SKIP() << "no CUDA device";
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const testing::RecomputeTrace a = testing::recompute_run(*gpu, GetParam(), Recompute::kNone, seed, 3);
  const testing::RecomputeTrace b = testing::recompute_run(*gpu, GetParam(), Recompute::kNone, seed, 3);
  EXPECT_TRUE(train::testing::same_bytes(a.aux_losses, b.aux_losses));
  train::testing::expect_bitwise_equal(a.trace, b.trace);
  if (::testing::Test::HasFailure()) GTEST_SKIP() << "a run of none does not repeat itself";
  testing::expect_recompute_bitwise(*gpu, GetParam(), 3);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaRecomputeVsNone,
    ::testing::Values(RecomputeCase{Recipe::kBF16, 1, false, true, false},
                      RecomputeCase{Recipe::kBF16, 2, true, false, true},
                      RecomputeCase{Recipe::kMxfp8, 2, false, true, false},
                      RecomputeCase{Recipe::kMxfp8, 1, true, false, false},
                      RecomputeCase{Recipe::kNvfp4, 2, true, true, false},
                      RecomputeCase{Recipe::kNvfp4, 1, false, false, true}),
    testing::recompute_case_name);

}  // namespace
}  // namespace packmoe
