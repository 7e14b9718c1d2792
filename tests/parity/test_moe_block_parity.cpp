// Single vs discrete layout of MoEBlock, bitwise: recipe {bf16, mxfp8, nvfp4} x primary weight
// {high, low} x grad-accum fusion {off, on} x delayed wgrad {off, on}. Two blocks with the same
// init and inputs train four AdamW steps (micro-batches that overwrite and accumulate, an eval
// forward, an expert starved of tokens, aux loss, norm_topk_prob); outputs, input gradients, every
// main_grad, master and primary-weight byte must be identical at every step. The run itself is
// tests/common/moe_block_harness.h's, on the CPU backend.
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "common/moe_block_harness.h"

namespace packmoe {
namespace {

using testing::Case;

class MoEBlockParity : public ::testing::TestWithParam<Case> {};

TEST_P(MoEBlockParity, SingleEqualsDiscreteBitwiseOverFourSteps) {
  testing::ParityRun run;
  testing::run_layout_parity(cpu_backend(), GetParam(), std::nullopt, &run);
}

INSTANTIATE_TEST_SUITE_P(Matrix, MoEBlockParity, ::testing::ValuesIn(testing::all_cases()),
                         testing::case_name);

}  // namespace
}  // namespace packmoe
