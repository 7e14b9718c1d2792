// GroupedLinear::forward with device token counts (the MoE block's path: no host wait) gives the
// bytes of the host-count forward on the CPU backend, in every recipe (tests/common/
// device_counts_checks.h; tests/cuda/test_cuda_moe_block.cpp runs the same on the GPU).
#include <gtest/gtest.h>

#include "common/device_counts_checks.h"

namespace packmoe {
namespace {

TEST(GroupedLinearDeviceCounts, SameBytesAsHostCounts) {
  for (Recipe r : {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4})
    for (bool delay : {false, true}) {
      testing::expect_device_counts_match_host(cpu_backend(), r, delay);
      if (HasFatalFailure()) return;
    }
}

}  // namespace
}  // namespace packmoe
