// The chunked LM head + cross-entropy (nn/lm_head_loss.h) on the CUDA backend: against the unfused
// FP64 reference (tests/common/lm_head_case.h) the loss within 1e-5 relative and dh, dW within a
// relative Frobenius 4e-3 (dlogits rounded to BF16 once); against the CPU backend the loss within
// 1e-5 and dh, dW within 4e-3 (a BF16 rounding of a dlogit flips on the FP32 differences); and the
// chunk size changes no byte on CUDA, on the sm_90a kernel and on cuBLASLt (every GEMM group is one
// token block whatever the chunk). Fresh seed per test; skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

#include "backend/backend.h"
#include "backend/cuda/kernel_policy.h"
#include "common/cuda_vs_cpu.h"
#include "common/lm_head_case.h"

namespace packmoe {
namespace {

using lm_head_case::Case;
using lm_head_case::HeadRun;

constexpr double kLossTol = 1e-5;
constexpr double kGradTol = 4e-3;

double rel_error(const std::vector<float>& a, const std::vector<float>& ref) {
  std::vector<double> r(ref.begin(), ref.end());
  return lm_head_case::rel_error(a, r);
}

void check_case(Backend& gpu, const Case& c, const LmHeadChunking& small,
                const LmHeadChunking& large) {
  const HeadRun g = lm_head_case::run_head(gpu, c, true, small);
  const lm_head_case::Reference ref = lm_head_case::reference(c);
  EXPECT_NEAR(g.loss, ref.loss, kLossTol * std::max(1.0, std::fabs(ref.loss)));
  EXPECT_LE(lm_head_case::rel_error(g.dh, ref.dh), kGradTol);
  EXPECT_LE(lm_head_case::rel_error(g.dw, ref.dw, &c.grad0), kGradTol);

  const HeadRun cpu = lm_head_case::run_head(cpu_backend(), c, true, small);
  EXPECT_NEAR(g.loss, cpu.loss, kLossTol * std::max(1.0f, std::fabs(cpu.loss)));
  EXPECT_LE(rel_error(g.dh, cpu.dh), kGradTol);
  std::vector<float> gd = g.dw, cd = cpu.dw;
  for (size_t i = 0; i < gd.size(); ++i) {
    gd[i] -= c.grad0[i];
    cd[i] -= c.grad0[i];
  }
  EXPECT_LE(rel_error(gd, cd), kGradTol);

  EXPECT_TRUE(lm_head_case::same_bytes(g, lm_head_case::run_head(gpu, c, true, large)))
      << "the chunk size changed the bytes";
  EXPECT_TRUE(lm_head_case::same_bytes(g, lm_head_case::run_head(gpu, c, true, small)))
      << "a second run changed the bytes";
  const HeadRun eval = lm_head_case::run_head(gpu, c, false, large);
  EXPECT_EQ(std::memcmp(&eval.loss, &g.loss, sizeof(float)), 0);
  EXPECT_TRUE(lm_head_case::same_bytes(eval.dw, c.grad0)) << "evaluation wrote a gradient";
}

TEST(CudaLmHeadLoss, SmallBlocksAgainstReferenceAndCpu) {
  PACKMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const Case c = lm_head_case::random_case(rng, 300, 72, 40, 0.2);
  check_case(*gpu, c, {64, 64}, {64, 192});
  // cuBLASLt: per-group algorithms, the same token counts per group whatever the chunk.
  KernelPolicy p;
  p.gemm.impl = GemmImpl::kCublasLt;
  const ScopedKernelPolicy use(p);
  EXPECT_TRUE(lm_head_case::same_bytes(lm_head_case::run_head(*gpu, c, true, {64, 64}),
                                       lm_head_case::run_head(*gpu, c, true, {64, 320})));
}

// The production block over two blocks at a larger vocabulary: the default chunk against two
// blocks per chunk.
TEST(CudaLmHeadLoss, DefaultBlocks) {
  PACKMOE_SKIP_WITHOUT_GPU();
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const Case c = lm_head_case::random_case(rng, kLmHeadBlockTokens + 200, 1024, 128, 0.1);
  check_case(*gpu, c, {}, {kLmHeadBlockTokens, 2 * kLmHeadBlockTokens});
}

}  // namespace
}  // namespace packmoe
